"""Expert parallelism without processes: which parameters are experts, the refusals decided on one rank, the order
full_state_dict puts every EP rank's experts in, and the expert accounting of HF conversions."""

from __future__ import annotations

import sys
from pathlib import Path

import paddle
import pytest
from paddle.distributed.fsdp import FullyShardFusion, UnsupportedGroupLayoutError
from paddle.distributed.fsdp.comm.expert_parallel import ExpertLayout, _local_problem, expert_parameter_ids
from paddle.distributed.fsdp.comm.topology import GroupLayout
from paddle.distributed.fsdp.state.full_params import _with_peer_experts
from paddle.distributed.fsdp.tools.preset_plan import expert_accounting

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from moe_models import EXPERTS, make_moe  # noqa: E402


class _Group:
    def __init__(self, nranks: int, rank: int = 0) -> None:
        self.nranks, self.rank, self.ranks = nranks, rank, list(range(nranks))


def _keys(model, ids) -> set[str]:
    return {k for k, p in model.named_parameters() if id(p) in ids}


def test_experts_are_listed_classes_in_expert_lists_and_marked_parameters():
    model = make_moe(1, dtype="float32")
    ids = expert_parameter_ids(model, ["MoeExpert"])
    keys = _keys(model, ids)
    assert len(keys) == 2 * EXPERTS * 3  # 2 blocks x 8 experts x (up.weight, down.weight, down.bias)
    assert all(".mlp.experts." in k for k in keys)
    assert not any("shared_expert" in k for k in _keys(model, ids))  # same class, not in a list: dense
    assert expert_parameter_ids(model, None) == set()  # upstream's default classes: none here
    model.blocks[0].mix.weight.expert = True  # PaddleFormers' marking counts whatever the class
    assert "blocks.0.mix.weight" in _keys(model, expert_parameter_ids(model, ()))


def test_layouts_refused_on_one_rank_by_name():
    experts = [("blocks.0.mlp.experts.0.up.weight", (8, 16))]
    world = GroupLayout()
    assert "no expert-parallel group" in _local_problem(None, world, experts, 2)
    assert _local_problem(None, world, [], 2) is None
    ep2 = ExpertLayout(_Group(2))
    assert "no parameter is an expert" in _local_problem(ep2, world, [], 2)
    assert "x expert shard degree 1 = 2 ranks, but the world has 4" in _local_problem(ep2, world, experts, 4)
    hsdp = GroupLayout(shard_group=_Group(2), replicate_group=_Group(2))
    assert "hybrid sharding" in _local_problem(ep2, hsdp, experts, 4)
    assert _local_problem(ExpertLayout(_Group(2), _Group(2)), world, experts, 4) is None


def test_one_process_without_ep_keeps_experts_dense():
    """One process without EP: moe_layers_name changes nothing (every expert is here; one process is exact)."""
    model = make_moe(1, dtype="float32")
    fsdp = FullyShardFusion(model, ["MoeDecoderBlock"], moe_layers_name=["MoeExpert"])
    assert fsdp.expert_layout is None and not any(b.layout.attrs.get("expert") for b in fsdp.buffers)


def test_fleet_without_ep_in_order_is_refused(monkeypatch):
    """Paddle 3.3.1's fleet ignores ep_degree unless hybrid_configs' order names "ep": refused, saying so."""
    from paddle.distributed import fleet

    class _PlainHcg:
        def get_sharding_parallel_world_size(self):
            return 1

    class _Strategy:
        hybrid_configs = {"ep_degree": 2, "moe_sharding_degree": 1}

    monkeypatch.setattr(fleet.fleet, "_hcg", _PlainHcg(), raising=False)
    monkeypatch.setattr(fleet.fleet, "_user_defined_strategy", _Strategy(), raising=False)
    model = make_moe(1, dtype="float32")
    with pytest.raises(UnsupportedGroupLayoutError, match="lacks 'ep' and 'moe_sharding'"):
        FullyShardFusion(model, ["MoeDecoderBlock"], moe_layers_name=["MoeExpert"])
    assert getattr(model, "_fsdp", None) is None


def test_full_state_dict_order_puts_every_ep_ranks_experts_in_place():
    """Each run of local expert keys becomes every EP rank's keys of that list, EP rank by EP rank; adjacent expert
    lists stay apart."""
    order = ["a", "l0.experts.0.w", "l0.experts.1.w", "l1.experts.0.w", "l1.experts.1.w", "z"]
    slot_keys = {
        "l0.experts.0.w": ["l0.experts.0.w", "l0.experts.2.w"],
        "l0.experts.1.w": ["l0.experts.1.w", "l0.experts.3.w"],
        "l1.experts.0.w": ["l1.experts.0.w", "l1.experts.2.w"],
        "l1.experts.1.w": ["l1.experts.1.w", "l1.experts.3.w"],
    }
    assert _with_peer_experts(order, slot_keys) == [
        "a",
        *[f"l0.experts.{e}.w" for e in range(4)],
        *[f"l1.experts.{e}.w" for e in range(4)],
        "z",
    ]


def test_expert_accounting_names_layers_and_index_ranges():
    names = [f"model.layers.{i}.mlp.experts.{e}.up_proj.weight" for i in (0, 3) for e in (4, 5, 6, 7, 9)]
    names.append("model.layers.1.self_attn.q_proj.weight")
    assert expert_accounting(names) == " (experts by layer: layer 0: [4-7, 9]; layer 3: [4-7, 9])"
    assert expert_accounting(["model.norm.weight"]) == ""


def test_moe_model_layout_does_not_depend_on_ep():
    """The test model's values do not depend on the EP degree: EP rank 1 of 2 holds experts 4..7 with EP=1's values."""
    one = dict(make_moe(3, dtype="float32").named_parameters())
    half = dict(make_moe(3, _Group(2, 1), dtype="float32").named_parameters())
    assert sorted(k for k in half if ".experts." in k)[0].startswith("blocks.0.mlp.experts.4.")
    for key, value in half.items():
        assert paddle.equal_all(value, one[key]).item(), key
