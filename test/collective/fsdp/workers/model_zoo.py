"""A zoo of model configurations: FSDP on N ranks against the same model in one process.

Each case builds a small model twice from one seed (one copy wrapped, one plain reference), trains a few
optimizer steps and compares losses, every local gradient piece, the parameters after the steps and the
persistable buffers. Batches differ per rank where the model allows it (the reference then averages the
per-rank losses, which is what FSDP's mean reduction computes); float64 where exactness matters.

Per-case outcomes are exchanged with all_gather_object after every case, so a case failing on one rank
reports instead of desynchronising the rest; a watchdog reports what finished and exits if a case hangs.
Each rank reports {case: "ok" | traceback}.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

D = 6
WORKDIR = [""]  # a directory shared by every rank (set by run)
CASE_TIMEOUT = float(os.environ.get("FSDP_ZOO_CASE_TIMEOUT", "60"))  # seconds; far below gloo's timeout


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.get_world_size() > 1 else (0, 1)


def batch(rank: int, step: int, shape=(4, D)) -> paddle.Tensor:
    rng = np.random.default_rng(1000 * step + rank)
    return paddle.to_tensor(rng.standard_normal(shape))


def tokens(rank: int, step: int, vocab: int, shape=(2, 7)) -> paddle.Tensor:
    rng = np.random.default_rng(1000 * step + rank + 17)
    return paddle.to_tensor(rng.integers(0, vocab, shape).astype(np.int64))


# ---- models ----------------------------------------------------------------------------------------------------
class Block(paddle.nn.Layer):
    def __init__(self, norm: str = "layer") -> None:
        super().__init__()
        self.fc = paddle.nn.Linear(D, D)
        self.norm = paddle.nn.LayerNorm(D) if norm == "layer" else paddle.nn.BatchNorm1D(D)

    def forward(self, x):
        return paddle.tanh(self.norm(self.fc(x)))


class BNNet(paddle.nn.Layer):
    """BatchNorm updates its running statistics (buffers) in forward; eval uses them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = paddle.nn.Linear(D, D)
        self.blocks = paddle.nn.LayerList([Block("batch"), Block("batch")])
        self.bn = paddle.nn.BatchNorm1D(D)  # loose, at the root
        self.head = paddle.nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.bn(h)).mean()


class TiedLM(paddle.nn.Layer):
    """Embedding + lm head sharing one weight: registered twice (``head.weight = embed.weight``) or used by the
    root's forward directly (``matmul(h, embed.weight, transpose_y=True)``)."""

    V = 11

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.embed = paddle.nn.Embedding(self.V, D)
        self.blocks = paddle.nn.LayerList([Block(), Block()])
        self.norm = paddle.nn.LayerNorm(D)
        if mode == "registered":
            self.head = TiedHead(self.embed.weight)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        h = self.norm(h)
        logits = self.head(h) if self.mode == "registered" else paddle.matmul(h, self.embed.weight, transpose_y=True)
        return F.cross_entropy(logits[:, :-1].reshape([-1, self.V]), ids[:, 1:].reshape([-1, 1])).mean()


class TiedHead(paddle.nn.Layer):
    def __init__(self, weight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, h):
        return paddle.matmul(h, self.weight, transpose_y=True)


class FrozenMix(paddle.nn.Layer):
    """Frozen and trainable parameters in one unit (and a frozen loose layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = paddle.nn.Linear(D, D)
        self.inp.weight.stop_gradient = True
        self.blocks = paddle.nn.LayerList([Block(), Block()])
        self.blocks[0].fc.weight.stop_gradient = True
        self.blocks[1].norm.bias.stop_gradient = True
        self.head = paddle.nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).pow(2).mean()


class RootLoose(paddle.nn.Layer):
    """Units plus loose layers and a parameter registered at the root itself, used in the root's forward; one
    unit object registered under two names and called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = paddle.nn.Linear(D, D)
        self.scale = self.create_parameter([D], default_initializer=paddle.nn.initializer.Normal())
        self.a = Block()
        self.mid = paddle.nn.Linear(D, D)
        self.b = self.a  # the same unit under two names
        self.c = Block()
        self.head = paddle.nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x) * self.scale
        h = self.a(h)
        h = self.mid(h)
        h = self.b(h) + self.scale
        h = self.c(h)
        return (self.head(h) + paddle.matmul(h, self.inp.weight).sum(-1, keepdim=True)).pow(2).mean()


class RecomputeNet(paddle.nn.Layer):
    """Reentrant recompute around units, with root parameters used before and after (their gradients arrive
    after the nested backward of the recomputed unit has ended)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = paddle.nn.Linear(D, D)
        self.blocks = paddle.nn.LayerList([Block(), Block()])
        self.head = paddle.nn.Linear(D, 1)

    def forward(self, x):
        from paddle.distributed.fleet.utils import recompute

        h = self.inp(x)
        for b in self.blocks:
            h = recompute(b, h, use_reentrant=True)
        return self.head(h).pow(2).mean()


class Expert(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.up = paddle.nn.Linear(D, 2 * D)
        self.down = paddle.nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class SkipMoE(paddle.nn.Layer):
    """Top-1 MoE that runs only experts with tokens (which experts run depends on each rank's data)."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.router = paddle.nn.Linear(D, n)
        self.experts = paddle.nn.LayerList([Expert() for _ in range(n)])

    def forward(self, x):
        flat = x.reshape([-1, D])
        probs = F.softmax(self.router(flat), axis=-1)
        choice = probs.argmax(-1).numpy()
        out = paddle.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = np.nonzero(choice == e)[0]
            if idx.size == 0:
                continue  # idle expert: skipped
            index = paddle.to_tensor(idx)
            y = expert(paddle.gather(flat, index)) * paddle.gather(probs[:, e : e + 1], index)
            out = paddle.scatter(out, index, y, overwrite=False)
        return out.reshape(x.shape)


class MoEBlock(paddle.nn.Layer):
    def __init__(self, moe: SkipMoE | None) -> None:
        super().__init__()
        self.attn = paddle.nn.Linear(D, D)
        self.moe = moe

    def forward(self, x, moe=None):
        h = x + paddle.tanh(self.attn(x))
        return h + (self.moe or moe)(h)


class MoENet(paddle.nn.Layer):
    """``inside``: MoE inside the unit; ``outside``: the MoE is registered at the root and called by the unit."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.inp = paddle.nn.Linear(D, D)
        self.where = where
        if where == "inside":
            self.blocks = paddle.nn.LayerList([MoEBlock(SkipMoE()), MoEBlock(SkipMoE())])
        else:
            self.blocks = paddle.nn.LayerList([MoEBlock(None), MoEBlock(None)])
            self.moes = paddle.nn.LayerList([SkipMoE(), SkipMoE()])
        self.head = paddle.nn.Linear(D, 1)

    def forward(self, x):
        h = self.inp(x)
        for k, b in enumerate(self.blocks):
            h = b(h) if self.where == "inside" else b(h, self.moes[k])
        return self.head(h).pow(2).mean()


# ---- comparison harness -------------------------------------------------------------------------------------------
def grad_pieces_match(fsdp, reference, rtol=1e-9, atol=1e-12) -> None:
    ref = {k: p.grad for k, p in reference.named_parameters()}
    for key, param, buffer, index in fsdp.managed_parameters():
        piece = buffer.pieces.get(index)
        if piece is None:
            continue
        want, got = ref[key], param.grad
        if want is None:
            assert got is None or float(got.abs().max()) == 0.0, f"{key}: gradient where the reference has none"
            continue
        assert got is not None, f"{key}: no gradient"
        expected = want.numpy().reshape([-1])[piece.param_start : piece.param_stop]
        np.testing.assert_allclose(got.numpy(), expected, rtol=rtol, atol=atol, err_msg=key)


def params_match(fsdp, reference, rtol=1e-9, atol=1e-12) -> None:
    full = fsdp.full_parameters()
    for key, value in reference.named_parameters():
        np.testing.assert_allclose(full[key].numpy(), value.numpy(), rtol=rtol, atol=atol, err_msg=key)
    ref_buffers = dict(reference.named_buffers())
    for key, value in fsdp.model.named_buffers():
        np.testing.assert_allclose(value.numpy(), ref_buffers[key].numpy(), rtol=rtol, atol=atol, err_msg=key)


def make_opt(model, kind: str):
    if kind == "groups":  # two groups, different LR and weight decay; LayerNorm params exempt from decay
        blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
        rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
        exempt = set()
        for n, p in model.named_parameters():
            if ".norm." in n or n.startswith("norm."):
                p.no_weight_decay = True  # FSDP honours this attribute ...
                exempt.add(p.name)
        return paddle.optimizer.AdamW(
            learning_rate=0.01,
            apply_decay_param_fun=lambda name: name not in exempt,  # ... stock paddle (the reference) this
            parameters=[
                {"params": blocks, "learning_rate": 0.5, "weight_decay": 0.3},
                {"params": rest},
            ],
            weight_decay=0.1,
            grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5),
        )
    return paddle.optimizer.AdamW(
        learning_rate=0.01,
        parameters=model.parameters(),
        weight_decay=0.1,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
    )


def train_compare(
    build,
    units,
    inputs,
    steps=2,
    same_data=False,
    opt_kind="adamw",
    micro=1,
    set_to_zero=True,
    check_grads=True,
):
    """Train the wrapped model and the reference side by side; compare loss, grads, params, buffers."""
    from paddle.distributed.fsdp import FullyShardFusion

    rank, size = world()
    paddle.seed(3)
    model = build()
    paddle.seed(3)
    reference = build()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=units)
    opt, ref_opt = make_opt(model, opt_kind), make_opt(reference, opt_kind)
    for step in range(steps):
        for m in range(micro):
            key = step * micro + m
            x = inputs(0 if same_data else rank, key)
            loss = model(x) / micro
            loss.backward()
            ranks = [0] if same_data else range(size)
            ref_total = None
            for r in ranks:
                ref_loss = reference(inputs(r, key)) / micro
                if r == rank:
                    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-9, err_msg=f"loss {key}")
                ref_total = ref_loss if ref_total is None else ref_total + ref_loss
            (ref_total / len(ranks)).backward()
        if check_grads and micro == 1:
            grad_pieces_match(fsdp, reference)
        opt.step()
        ref_opt.step()
        opt.clear_grad(set_to_zero=set_to_zero)
        ref_opt.clear_grad(set_to_zero=set_to_zero)
    params_match(fsdp, reference)
    return fsdp, model, reference


# ---- cases ---------------------------------------------------------------------------------------------------------
def case_batchnorm():
    fsdp, model, ref = train_compare(BNNet, ["Block"], batch, steps=2, same_data=True)
    for m in (model, ref):
        m.eval()
    with paddle.no_grad():
        x = batch(9, 9)
        np.testing.assert_allclose(model(x).numpy(), ref(x).numpy(), rtol=1e-10)
    loss = model(batch(0, 5))  # eval mode with grad: running stats frozen, gradients still flow
    ref_loss = ref(batch(0, 5))
    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-10)
    loss.backward()
    ref_loss.backward()
    grad_pieces_match(fsdp, ref)
    for m in (model, ref):
        m.train()
    params_match(fsdp, ref)
    # running statistics are state: checkpointed, restored, and in full_state_dict
    path = os.path.join(WORKDIR[0], "batchnorm")
    fsdp.save_checkpoint(path)
    paddle.seed(4)
    fresh = BNNet()
    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.checkpoint import load_full_state_dict

    fresh_fsdp = FullyShardFusion(fresh, fsdp_unit_layers=["Block"])
    fresh_fsdp.load_checkpoint(path)
    params_match(fresh_fsdp, ref)
    saved = load_full_state_dict(path)
    state = fresh_fsdp.full_state_dict(rank0_only=False)
    assert list(state) == list(ref.state_dict()), (list(state), list(ref.state_dict()))
    for key, value in ref.state_dict().items():
        np.testing.assert_allclose(state[key].numpy(), value.numpy(), rtol=1e-10, err_msg=key)
        np.testing.assert_allclose(saved[key].numpy(), value.numpy(), rtol=1e-10, err_msg=key)


def case_tied_registered():
    train_compare(lambda: TiedLM("registered"), ["Block"], lambda r, s: tokens(r, s, TiedLM.V))


def case_tied_root_use():
    train_compare(lambda: TiedLM("root_use"), ["Block"], lambda r, s: tokens(r, s, TiedLM.V))


def case_tied_no_units():
    train_compare(lambda: TiedLM("root_use"), None, lambda r, s: tokens(r, s, TiedLM.V))


def case_frozen_mixed():
    train_compare(FrozenMix, ["Block"], batch, steps=3)


def case_groups_no_decay():
    train_compare(lambda: TiedLM("registered"), ["Block"], lambda r, s: tokens(r, s, TiedLM.V), opt_kind="groups")


def case_accumulation_keep_grad():
    train_compare(FrozenMix, ["Block"], batch, steps=2, micro=3, set_to_zero=False)


def case_accumulation_zeroed():
    train_compare(RootLoose, ["Block"], batch, steps=2, micro=2, set_to_zero=True)


def case_root_loose():
    train_compare(RootLoose, ["Block"], batch, steps=2)


def case_root_loose_no_units():
    train_compare(RootLoose, None, batch, steps=2)


def case_recompute_reentrant():
    train_compare(RecomputeNet, ["Block"], batch, steps=2)


def case_moe_inside_units():
    train_compare(lambda: MoENet("inside"), ["MoEBlock"], batch, steps=2)


def case_moe_no_units():
    train_compare(lambda: MoENet("inside"), None, batch, steps=2)


def case_moe_outside_unit():
    train_compare(lambda: MoENet("outside"), ["MoEBlock"], batch, steps=2)


def case_optimizer_before_wrap():
    """The optimizer is built on the unwrapped model, then the model is wrapped (parameter objects survive)."""
    from paddle.distributed.fsdp import FullyShardFusion

    rank, size = world()
    paddle.seed(3)
    model = RootLoose()
    paddle.seed(3)
    reference = RootLoose()
    opt, ref_opt = make_opt(model, "adamw"), make_opt(reference, "adamw")
    opt.clear_grad()  # before any backward
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    for step in range(2):
        model(batch(rank, step)).backward()
        (sum(reference(batch(r, step)) for r in range(size)) / size).backward()
        grad_pieces_match(fsdp, reference)
        opt.step()
        ref_opt.step()
        opt.clear_grad()
        ref_opt.clear_grad()
    params_match(fsdp, reference)


class Backbone(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.inp = paddle.nn.Linear(D, D)
        self.blocks = paddle.nn.LayerList([Block(), Block()])

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return h


class TwoPart(paddle.nn.Layer):
    """Called part by part (``model.backbone(x)``, then ``model.head(h)``): the root's forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone()
        self.head = paddle.nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.backbone(x)).pow(2).mean()


def case_submodules_called_alone():
    from paddle.distributed.fsdp import FullyShardFusion

    rank, size = world()
    paddle.seed(3)
    model = TwoPart()
    paddle.seed(3)
    reference = TwoPart()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt, ref_opt = make_opt(model, "adamw"), make_opt(reference, "adamw")

    def loss_of(m, x):
        return m.head(m.backbone(x)).pow(2).mean()

    for step in range(2):
        loss_of(model, batch(rank, step)).backward()
        (sum(loss_of(reference, batch(r, step)) for r in range(size)) / size).backward()
        grad_pieces_match(fsdp, reference)
        opt.step()
        ref_opt.step()
        opt.clear_grad()
        ref_opt.clear_grad()
    params_match(fsdp, reference)
    with paddle.no_grad():  # and the whole model once more
        np.testing.assert_allclose(model(batch(5, 5)).numpy(), reference(batch(5, 5)).numpy(), rtol=1e-10)
    assert not any(b.is_gathered for b in fsdp.buffers)


def case_moe_expert_units():
    """Experts as units, idle ones skipped: the experts' gathers differ per rank. Unsupported on several ranks;
    it must fail on every rank at once with a named error (never a gloo abort or timeout)."""
    from paddle.distributed.fsdp.comm.communication import CHECK_ORDER_ENV

    os.environ[CHECK_ORDER_ENV] = "1"  # the order check is off by default (overlap.py); this case needs it
    try:
        _moe_expert_units()
    finally:
        del os.environ[CHECK_ORDER_ENV]


def _moe_expert_units():
    from paddle.distributed.fsdp.comm.communication import CollectiveOrderError

    if world()[1] == 1:
        train_compare(lambda: MoENet("inside"), ["Expert"], batch, steps=2)
        return
    try:
        train_compare(lambda: MoENet("inside"), ["Expert"], batch, steps=2)
    except CollectiveOrderError as e:
        assert "experts" in str(e) and "rank 1" in str(e), str(e)
    else:
        raise AssertionError("experts run on some ranks only were not refused")


def case_eval_modes():
    """model.eval()/train() switch and no_grad evaluation between steps, units and loose layers."""
    fsdp, model, ref = train_compare(RootLoose, ["Block"], batch, steps=1)
    for mode in ("eval", "train"):
        getattr(model, mode)()
        getattr(ref, mode)()
        assert all(layer.training == (mode == "train") for layer in model.sublayers())
        with paddle.no_grad():
            x = batch(3, 3)
            np.testing.assert_allclose(model(x).numpy(), ref(x).numpy(), rtol=1e-10)
    # no gathered buffer is left behind by no_grad forwards
    assert not any(b.is_gathered for b in fsdp.buffers), [b.layout.name for b in fsdp.buffers if b.is_gathered]


CASES = {
    "batchnorm": case_batchnorm,
    "tied_registered": case_tied_registered,
    "tied_root_use": case_tied_root_use,
    "tied_no_units": case_tied_no_units,
    "frozen_mixed": case_frozen_mixed,
    "groups_no_decay": case_groups_no_decay,
    "accumulation_keep_grad": case_accumulation_keep_grad,
    "accumulation_zeroed": case_accumulation_zeroed,
    "root_loose": case_root_loose,
    "root_loose_no_units": case_root_loose_no_units,
    "eval_modes": case_eval_modes,
    "submodules_called_alone": case_submodules_called_alone,
    "optimizer_before_wrap": case_optimizer_before_wrap,
    "moe_expert_units": case_moe_expert_units,
    "recompute_reentrant": case_recompute_reentrant,
    "moe_inside_units": case_moe_inside_units,
    "moe_no_units": case_moe_no_units,
    "moe_outside_unit": case_moe_outside_unit,
}


# ---- PaddleFormers causal LMs --------------------------------------------------------------------------------------
PF_CASES = ["llama", "llama-fused", "qwen2", "qwen2-fused", "qwen2-tied", "pf_units_bound_memory"]


def pf_build(preset: str):
    from pf_models import COMMON, family_of, paddle_model

    tied = preset.endswith("-tied")
    family, fused = family_of(preset[: -len("-tied")] if tied else preset)
    cfg = dict(COMMON, num_hidden_layers=2, tie_word_embeddings=tied)
    return paddle_model(family, fused, cfg, seed=5)


def pf_loss(model, ids):
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape([-1, vocab]), ids[:, 1:].reshape([-1, 1])).mean()


def pf_opt(model):
    return paddle.optimizer.AdamW(
        learning_rate=1e-3,
        parameters=model.parameters(),
        weight_decay=0.01,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
    )


def pf_step(model, opt, rank, step):
    loss = pf_loss(model, tokens(rank, step, 96))
    loss.backward()
    opt.step()
    opt.clear_grad()
    return float(loss)


def case_pf(preset: str, workdir: str):
    from paddle.distributed.fsdp import FullyShardFusion
    from pf_models import decoder_layer, family_of

    rank, size = world()
    unit = decoder_layer(family_of(preset.replace("-tied", ""))[0])
    model, reference = pf_build(preset), pf_build(preset)
    model.train()
    reference.train()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=[unit])
    text = repr(model)
    assert "Linear(" in text or "in_features" in text, text[:200]
    opt, ref_opt = pf_opt(model), pf_opt(reference)
    for step in range(2):  # FSDP vs one process (fp32: tolerance)
        loss = pf_loss(model, tokens(rank, step, 96))
        loss.backward()
        ref_total = sum(pf_loss(reference, tokens(r, step, 96)) for r in range(size)) / size
        ref_total.backward()
        opt.step()
        ref_opt.step()
        opt.clear_grad()
        ref_opt.clear_grad()
    full = fsdp.full_parameters()
    for key, value in reference.named_parameters():
        np.testing.assert_allclose(full[key].numpy(), value.numpy(), rtol=2e-4, atol=2e-5, err_msg=key)
    # summon_full_params(writeback=True) then one step: changes inside reach the shards
    with fsdp.summon_full_params(writeback=True):
        with paddle.no_grad():
            for p in model.parameters():
                p.scale_(0.5)
    with paddle.no_grad():
        for p in reference.parameters():
            p.scale_(0.5)
    pf_step(model, opt, rank, 7)
    sum(pf_loss(reference, tokens(r, 7, 96)) for r in range(size)).__truediv__(size).backward()
    ref_opt.step()
    ref_opt.clear_grad()
    full = fsdp.full_parameters()
    for key, value in reference.named_parameters():
        np.testing.assert_allclose(full[key].numpy(), value.numpy(), rtol=5e-4, atol=5e-5, err_msg=key)
    # save, continue, resume into a fresh wrapped model: bit-exact
    path = os.path.join(workdir, preset)
    fsdp.save_checkpoint(path, optimizer=opt, extra_state={"step": 3})
    losses = [pf_step(model, opt, rank, 10 + s) for s in range(2)]
    after = fsdp.full_parameters()
    fresh = pf_build(preset)
    fresh.train()
    fresh_fsdp = FullyShardFusion(fresh, fsdp_unit_layers=[unit])
    fresh_opt = pf_opt(fresh)
    extra = fresh_fsdp.load_checkpoint(path, optimizer=fresh_opt)
    assert extra["step"] == 3
    resumed = [pf_step(fresh, fresh_opt, rank, 10 + s) for s in range(2)]
    assert resumed == losses, (resumed, losses)
    for key, value in fresh_fsdp.full_parameters().items():
        assert np.array_equal(value.numpy(), after[key].numpy()), key
    # full_state_dict into an unwrapped model: identical logits
    state = fresh_fsdp.full_state_dict(rank0_only=False)
    plain = pf_build(preset)
    missing, unexpected = plain.set_state_dict(state)
    assert not missing and not unexpected, (missing, unexpected)
    fresh.eval()
    plain.eval()
    ids = tokens(0, 99, 96)
    with paddle.no_grad():
        a = fresh(ids)
        b = plain(ids)
    a = a.logits if hasattr(a, "logits") else a[0]
    b = b.logits if hasattr(b, "logits") else b[0]
    assert np.array_equal(a.numpy(), b.numpy())


def gathered_peak(fsdp) -> dict:
    """Track the peak of gathered (full-size) parameter bytes on this rank; returns a live dict."""
    state = {"now": 0, "peak": 0}
    for buffer in fsdp.buffers:
        size = buffer.layout.padded_numel * buffer.shard.element_size()

        def gather(buffer=buffer, size=size, original=buffer.gather):
            was = buffer.is_gathered
            original()
            if not was:
                state["now"] += size
                state["peak"] = max(state["peak"], state["now"])

        def release(buffer=buffer, size=size, original=buffer.release):
            was = buffer.is_gathered
            original()
            if was:
                state["now"] -= size

        buffer.gather, buffer.release = gather, release
    return state


def case_pf_units_bound_memory():
    """Loose layers are gathered by the root for its whole forward and backward; listing the embedding and
    lm head classes as units bounds the gathered peak again (both give the same training result)."""
    from paddle.distributed.fsdp import FullyShardFusion

    rank, size = world()
    peaks, losses = {}, {}
    for name, units in {
        "decoder_only": ["LlamaDecoderLayer"],
        "with_embed_head": ["LlamaDecoderLayer", "Embedding", "LlamaLMHead"],
    }.items():
        model = pf_build("llama")
        model.train()
        fsdp = FullyShardFusion(model, fsdp_unit_layers=units)
        state = gathered_peak(fsdp)
        losses[name] = [pf_step(model, pf_opt(model), rank, s) for s in range(1)]
        peaks[name] = state["peak"]
        assert state["now"] == 0, state
    print(f"gathered peak bytes per rank ({size} ranks): {peaks}", flush=True)
    assert losses["decoder_only"] == losses["with_embed_head"], losses
    if size > 1:
        assert peaks["with_embed_head"] < peaks["decoder_only"], peaks


# ---- runner --------------------------------------------------------------------------------------------------------
def run(selected: list[str]) -> dict:
    from launch_util import report

    rank, size = world()
    results: dict[str, str] = {}
    current = {"case": None, "since": time.monotonic()}

    def watchdog():
        while True:
            time.sleep(1.0)
            if current["case"] and time.monotonic() - current["since"] > CASE_TIMEOUT:
                results[current["case"]] = f"hung: no progress for {CASE_TIMEOUT:.0f}s on {size} rank(s)"
                report(results)
                print(f"case {current['case']} hung; exiting", file=sys.stderr, flush=True)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    workdir = tempfile.mkdtemp(prefix="fsdp-model-zoo-") if rank == 0 else None
    if size > 1:
        holder = [workdir]
        dist.broadcast_object_list(holder, src=0)
        workdir = holder[0]
    WORKDIR[0] = workdir
    for name in selected:
        current.update(case=name, since=time.monotonic())
        paddle.set_default_dtype("float32" if name in PF_CASES else "float64")
        try:
            if name == "pf_units_bound_memory":
                case_pf_units_bound_memory()
            elif name in PF_CASES:
                case_pf(name, workdir)
            else:
                CASES[name]()
            mine = "ok"
        except Exception:  # noqa: BLE001 - reported per case
            mine = traceback.format_exc()
        finally:
            paddle.set_default_dtype("float32")
        outcomes = [mine] if size == 1 else []
        if size > 1:
            dist.all_gather_object(outcomes, mine)
        failed = [(r, o) for r, o in enumerate(outcomes) if o != "ok"]
        results[name] = mine if mine != "ok" else ("ok" if not failed else f"failed on rank {failed[0][0]}")
        report(results)
    current["case"] = None
    if size > 1:
        dist.barrier()
    if rank == 0:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def main() -> None:
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    selected = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES) + PF_CASES
    results = run(selected)
    bad = {k: v for k, v in results.items() if v != "ok"}
    if bad:
        print(bad, file=sys.stderr)


if __name__ == "__main__":
    main()
