# Copyright (c) 2025 PaddlePaddle Authors. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Single-process tests of state.optimizer_states: every stateful optimizer of
paddle 3.3.1 is fully covered, kinds are right, and create + in-place load
resumes bit-exactly."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import paddle
import pytest
from paddle import nn
from paddle.distributed.fsdp.state import optimizer_json_state as osj
from paddle.distributed.fsdp.state import optimizer_state_creation as osc
from paddle.distributed.fsdp.state import optimizer_states as osn
from paddle.optimizer.lr import LRScheduler

E, S, K = osn.ELEMENTWISE, osn.SCALAR, osn.STACKED
O = paddle.optimizer
L = paddle.optimizer.lr


def _set_global_state(opt, state) -> None:
    """Restore what optimizer_global_state returned (decoding checks everything first)."""
    osj.decode_optimizer_global_state(opt, state)()


@pytest.fixture(autouse=True)
def _quiet_dygraph():
    paddle.disable_static()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------- models


class Dense(nn.Layer):
    """Linear layer: a 2-D weight and a 1-D bias."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc(x)


class Flat(nn.Layer):
    """Params stored 1-D, like the flattened pieces FSDP steps on, including
    a 1-element piece (elementwise and scalar shapes coincide) and an empty
    piece (a rank that holds none of a param)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = self.create_parameter([12])
        self.b = self.create_parameter([3], is_bias=True)
        self.one = self.create_parameter([1])
        self.empty = self.create_parameter([0])

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = paddle.matmul(x, self.w.reshape([4, 3])) + self.b
        return out * self.one + self.empty.sum()


class LowPrecision(nn.Layer):
    """bf16 params; compute in fp32 because CPU has no bf16 matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.w = self.create_parameter([4, 3], dtype="bfloat16")
        self.b = self.create_parameter([3], dtype="bfloat16", is_bias=True)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(x, self.w.astype("float32")) + self.b.astype("float32")


# ------------------------------------------------------------------ configs

ADAM = {
    "moment1": E,
    "moment2": E,
    "beta1_pow_acc": S,
    "beta2_pow_acc": S,
}
RMSPROP = {"momentum": E, "mean_square": E, "mean_grad": E}
NADAM = dict.fromkeys(["momentum_decay_pow", "beta2_pow", "mu_product", "moment1", "moment2"], E)
RADAM = dict.fromkeys(["beta1_pow", "beta2_pow", "rho", "moment1", "moment2"], E)


@dataclass
class Config:
    name: str
    build: Callable[[nn.Layer], paddle.optimizer.Optimizer]
    kinds: dict[str, str]
    models: tuple[type[nn.Layer], ...] = (Dense, Flat)
    master: bool = False
    set_lr: float | None = None  # only the original run calls set_lr


def _groups(model: nn.Layer, **first: float) -> list[dict]:
    params = model.parameters()
    return [{"params": params[:1], **first}, {"params": params[1:]}]


CONFIGS = [
    Config("adam", lambda m: O.Adam(0.01, parameters=m.parameters()), ADAM),
    Config(
        "adam_amsgrad",
        lambda m: O.Adam(0.01, parameters=m.parameters(), amsgrad=True),
        {**ADAM, "moment2_max": E},
    ),
    Config(
        "adam_multi_tensor",
        lambda m: O.Adam(0.01, parameters=m.parameters(), use_multi_tensor=True),
        ADAM,
    ),
    Config(
        "adam_groups",
        lambda m: O.Adam(0.01, parameters=_groups(m, beta1=0.8, epsilon=1e-6)),
        ADAM,
    ),
    Config(
        "adam_set_lr",
        lambda m: O.Adam(0.01, parameters=m.parameters()),
        ADAM,
        set_lr=0.003,
    ),
    Config(
        "adamw_named",
        lambda m: O.AdamW(0.01, parameters=m.parameters(), weight_decay=0.1, name="opt"),
        ADAM,
    ),
    Config(
        "adamw_warm_restarts",
        lambda m: O.AdamW(
            L.CosineAnnealingWarmRestarts(0.01, T_0=2, T_mult=2),
            parameters=m.parameters(),
        ),
        ADAM,
    ),
    Config(
        "adamax",
        lambda m: O.Adamax(0.01, parameters=m.parameters()),
        {"moment": E, "inf_norm": E, "beta1_pow_acc": S},
    ),
    Config("rmsprop", lambda m: O.RMSProp(0.01, parameters=m.parameters()), RMSPROP),
    Config(
        "rmsprop_centered_momentum",
        lambda m: O.RMSProp(0.01, parameters=m.parameters(), centered=True, momentum=0.9),
        RMSPROP,
    ),
    Config(
        "adadelta",
        lambda m: O.Adadelta(0.5, parameters=m.parameters()),
        {"avg_squared_grad": E, "avg_squared_update": E},
    ),
    Config("nadam", lambda m: O.NAdam(0.01, parameters=m.parameters()), NADAM),
    Config("radam", lambda m: O.RAdam(0.01, parameters=m.parameters()), RADAM),
    Config(
        "momentum",
        lambda m: O.Momentum(0.01, parameters=m.parameters()),
        {"velocity": E},
    ),
    Config(
        "momentum_nesterov_named",
        lambda m: O.Momentum(
            0.01,
            parameters=m.parameters(),
            use_nesterov=True,
            weight_decay=0.01,
            name="mom",
        ),
        {"velocity": E},
    ),
    Config(
        "momentum_multi_tensor",
        lambda m: O.Momentum(0.01, parameters=m.parameters(), use_multi_tensor=True),
        {"velocity": E},
    ),
    Config("lamb", lambda m: O.Lamb(0.01, parameters=m.parameters()), ADAM),
    Config(
        "adagrad",
        lambda m: O.Adagrad(0.1, parameters=m.parameters()),
        {"moment": E},
    ),
    Config(
        "adagrad_groups",
        lambda m: O.Adagrad(
            0.1,
            parameters=_groups(m, initial_accumulator_value=0.5),
            initial_accumulator_value=0.1,
        ),
        {"moment": E},
    ),
    Config(
        "asgd",
        lambda m: O.ASGD(0.01, batch_num=2, parameters=m.parameters()),
        {"d": E, "y": K, "m": S},
    ),
    Config(
        "rprop",
        lambda m: O.Rprop(0.01, parameters=m.parameters()),
        {"prevs": E, "learning_rates": E},
    ),
    Config(
        "sgd_step_decay",
        lambda m: O.SGD(L.StepDecay(0.1, 2, 0.5), parameters=m.parameters()),
        {},
    ),
    Config(
        "sgd_bf16_master",
        lambda m: O.SGD(0.1, parameters=m.parameters(), multi_precision=True),
        {},
        models=(LowPrecision,),
        master=True,
    ),
    Config(
        "rprop_bf16_master",
        lambda m: O.Rprop(0.01, parameters=m.parameters(), multi_precision=True),
        {"prevs": E, "learning_rates": E},
        models=(LowPrecision,),
        master=True,
    ),
]

CASES = [pytest.param(cfg, model, id=f"{cfg.name}-{model.__name__}") for cfg in CONFIGS for model in cfg.models]


# ------------------------------------------------------------------ helpers


def _batches(n: int = 6) -> list[paddle.Tensor]:
    paddle.seed(1234)
    return [paddle.randn([5, 4]) for _ in range(n)]


def _build(cfg: Config, model_cls: type[nn.Layer], seed: int):
    paddle.seed(seed)
    model = model_cls()
    return model, cfg.build(model)


def _train(model: nn.Layer, opt, batches: list[paddle.Tensor]) -> None:
    for x in batches:
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        if isinstance(opt._learning_rate, LRScheduler):
            opt._learning_rate.step()


def _bits(t: paddle.Tensor) -> bytes:
    return t.numpy().tobytes()


def _target_name(opt, param) -> str:
    master = opt._master_weights.get(param.name)
    return param.name if master is None else master.name


def _snapshot(model, opt) -> tuple[list, list[dict[str, paddle.Tensor]]]:
    params = [p.detach().clone() for p in model.parameters()]
    states = [
        {e.state_name: e.tensor.detach().clone() for e in osn.optimizer_state_entries(opt, p)}
        for p in model.parameters()
    ]
    return params, states


def _assert_same_run(model_a, opt_a, model_b, opt_b) -> None:
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert _bits(pa) == _bits(pb), pa.name
        ea = {e.state_name: e for e in osn.optimizer_state_entries(opt_a, pa)}
        eb = {e.state_name: e for e in osn.optimizer_state_entries(opt_b, pb)}
        assert ea.keys() == eb.keys()
        for name in ea:
            assert ea[name].kind == eb[name].kind
            assert ea[name].tensor.dtype == eb[name].tensor.dtype
            assert _bits(ea[name].tensor) == _bits(eb[name].tensor), name
    assert opt_a.get_lr() == opt_b.get_lr()


# -------------------------------------------------------------------- tests


@pytest.mark.parametrize("cfg,model_cls", CASES)
def test_entries_cover_every_accumulator(cfg: Config, model_cls) -> None:
    model, opt = _build(cfg, model_cls, seed=1)
    _train(model, opt, _batches(2))

    total = 0
    for p in model.parameters():
        entries = osn.optimizer_state_entries(opt, p)
        target = _target_name(opt, p)
        live = {id(acc[target]) for acc in opt._accumulators.values() if target in acc}
        got = {id(e.tensor) for e in entries if e.state_name != "master_weight"}
        assert got == live and len(got) == len(live) == len(cfg.kinds)
        total += len(live)

        kinds = {e.state_name: e.kind for e in entries}
        expected = dict(cfg.kinds)
        if cfg.master:
            expected["master_weight"] = E
            master = opt._master_weights[p.name]
            assert any(e.tensor is master for e in entries)
            assert master.dtype == paddle.float32
        assert kinds == expected

        for e in entries:
            shape, pshape = list(e.tensor.shape), list(p.shape)
            if e.kind == E:
                assert shape == pshape
            elif e.kind == S:
                assert shape == [1]
            else:
                assert shape == [2, *pshape]  # ASGD batch_num=2
    assert total == sum(len(v) for v in opt._accumulators.values())
    covered = osn.all_optimizer_state_entries(opt, model.parameters())
    assert sum(len(v) for v in covered.values()) == total + len(opt._master_weights)


@pytest.mark.parametrize("cfg,model_cls", CASES)
def test_bit_exact_resume(cfg: Config, model_cls) -> None:
    batches = _batches()
    model_a, opt_a = _build(cfg, model_cls, seed=1)
    if cfg.set_lr is not None:
        opt_a.set_lr(cfg.set_lr)
    _train(model_a, opt_a, batches[:3])
    saved_params, saved_states = _snapshot(model_a, opt_a)
    saved_global = json.loads(json.dumps(osj.optimizer_global_state(opt_a), allow_nan=False))

    model_b, opt_b = _build(cfg, model_cls, seed=2)
    assert any(_bits(pa) != _bits(pb) for pa, pb in zip(model_a.parameters(), model_b.parameters()))
    params_before = [_bits(p) for p in model_b.parameters()]
    lr_before = opt_b.get_lr()
    osc.create_optimizer_state(opt_b)
    assert [_bits(p) for p in model_b.parameters()] == params_before
    assert opt_b.get_lr() == lr_before

    for p, value, states in zip(model_b.parameters(), saved_params, saved_states):
        osc.copy_into_state_(p, value)
        entries = osn.optimizer_state_entries(opt_b, p)
        assert {e.state_name for e in entries} == states.keys()
        for e in entries:
            osc.copy_into_state_(e.tensor, states[e.state_name])
    _set_global_state(opt_b, saved_global)

    _train(model_a, opt_a, batches[3:])
    _train(model_b, opt_b, batches[3:])
    _assert_same_run(model_a, opt_a, model_b, opt_b)


@pytest.mark.parametrize("cfg,model_cls", CASES)
def test_eager_creation_matches_lazy_first_step(cfg: Config, model_cls) -> None:
    """Creating state before the first step is unobservable: same initial
    values (beta powers, Adagrad/Rprop initial values, master casts)."""
    batches = _batches(3)
    model_a, opt_a = _build(cfg, model_cls, seed=1)
    model_b, opt_b = _build(cfg, model_cls, seed=1)
    osc.create_optimizer_state(opt_b)
    assert sum(len(v) for v in opt_b._accumulators.values()) == len(cfg.kinds) * len(model_b.parameters())
    _train(model_a, opt_a, batches)
    _train(model_b, opt_b, batches)
    _assert_same_run(model_a, opt_a, model_b, opt_b)


def test_create_keeps_group_hyperparameters() -> None:
    model = Dense()
    groups = _groups(model)
    groups[-1]["beta1"] = 0.5  # the last group's value would stick
    opt = O.Adam(0.01, parameters=groups, beta1=0.9)
    osc.create_optimizer_state(opt)
    assert opt._beta1 == 0.9  # group dict values are not left behind
    opt2 = O.Adagrad(
        0.1,
        parameters=_groups(Dense(), initial_accumulator_value=0.5),
        initial_accumulator_value=0.1,
    )
    osc.create_optimizer_state(opt2)
    assert opt2.initial_accumulator_value == 0.1
    values = sorted(float(t.flatten()[0]) for t in opt2._accumulators["moment"].values())
    assert values == pytest.approx([0.1, 0.5])


def test_create_only_given_params_and_skips_frozen() -> None:
    model = Dense()
    model.fc.bias.stop_gradient = True
    opt = O.Adam(0.01, parameters=model.parameters())
    osc.create_optimizer_state(opt)
    assert osn.optimizer_state_entries(opt, model.fc.bias) == []
    assert len(osn.optimizer_state_entries(opt, model.fc.weight)) == 4

    model2 = Dense()
    opt2 = O.Adam(0.01, parameters=model2.parameters())
    osc.create_optimizer_state(opt2, [model2.fc.bias])
    assert osn.optimizer_state_entries(opt2, model2.fc.weight) == []
    assert len(osn.optimizer_state_entries(opt2, model2.fc.bias)) == 4

    # A tensor the optimizer does not list (e.g. an FSDP buffer it is handed
    # at step time) gets state too, unless param groups make it ambiguous.
    extra = paddle.create_parameter([5], "float32")
    osc.create_optimizer_state(opt2, [extra])
    assert {e.state_name for e in osn.optimizer_state_entries(opt2, extra)} == (ADAM.keys())
    grouped = O.Adam(0.01, parameters=_groups(Dense()))
    with pytest.raises(ValueError, match="none of the param groups"):
        osc.create_optimizer_state(grouped, [extra])


def test_refresh_master_weight_after_loading_param() -> None:
    """A master weight created before the param is loaded must be re-cast
    when the checkpoint has none (param had no gradient before the save)."""
    batches = _batches(2)
    paddle.seed(1)
    model_a = LowPrecision()
    opt_a = O.SGD(0.1, parameters=model_a.parameters(), multi_precision=True)
    paddle.seed(2)
    model_b = LowPrecision()
    opt_b = O.SGD(0.1, parameters=model_b.parameters(), multi_precision=True)
    osc.create_optimizer_state(opt_b)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        osc.copy_into_state_(pb, pa.detach().clone())
        osc.refresh_master_weight_(opt_b, pb)
    _train(model_a, opt_a, batches)
    _train(model_b, opt_b, batches)
    _assert_same_run(model_a, opt_a, model_b, opt_b)


def test_state_names_ignore_optimizer_name_and_counters() -> None:
    model = Dense()
    plain = O.AdamW(0.01, parameters=model.parameters())
    named = O.AdamW(0.01, parameters=model.parameters(), name="opt")
    for x in _batches(1):
        (model(x) ** 2).mean().backward()
        plain.step()
        named.step()
        model.clear_gradients()
    w = model.fc.weight
    plain_entries = osn.optimizer_state_entries(plain, w)
    named_entries = osn.optimizer_state_entries(named, w)
    assert [e.state_name for e in plain_entries] == [e.state_name for e in named_entries]
    assert {e.accumulator_key for e in named_entries} == {f"opt_{name}" for name in ADAM}
    # Two optimizers on one param: distinct live tensors, counters differ.
    for a, b in zip(plain_entries, named_entries):
        assert a.tensor is not b.tensor and a.tensor.name != b.tensor.name
        assert a.tensor is plain._accumulators[a.accumulator_key][w.name]
        assert b.tensor is named._accumulators[b.accumulator_key][w.name]


def test_two_unnamed_optimizers_on_one_param() -> None:
    model = Dense()
    first = O.Adam(0.01, parameters=model.parameters())
    second = O.Adam(0.02, parameters=model.parameters())
    (model(_batches(1)[0]) ** 2).mean().backward()
    first.step()
    second.step()
    w = model.fc.weight
    e1 = {e.state_name: e.tensor for e in osn.optimizer_state_entries(first, w)}
    e2 = {e.state_name: e.tensor for e in osn.optimizer_state_entries(second, w)}
    assert e1.keys() == e2.keys() == ADAM.keys()
    assert e1["moment1"].name.endswith("_0") and e2["moment1"].name.endswith("_1")
    assert all(e1[k] is not e2[k] for k in e1)


class _AdamWithEma(O.Adam):
    def _add_moments_pows(self, p):
        super()._add_moments_pows(p)
        self._add_accumulator("ema", p)


class _PlainAdamSubclass(O.Adam):
    pass


class _AdamWithOddMoment(O.Adam):
    def _add_moments_pows(self, p):
        self._add_accumulator("moment1", p, shape=[7])


@pytest.mark.parametrize("name", [None, "x"])
def test_undeclared_accumulator_is_refused(name) -> None:
    model = Dense()
    opt = _AdamWithEma(0.01, parameters=model.parameters(), name=name)
    _train(model, opt, _batches(1))
    key = "ema" if name is None else "x_ema"
    with pytest.raises(osn.UnsupportedOptimizerStateError) as err:
        osn.optimizer_state_entries(opt, model.fc.weight)
    assert "_AdamWithEma" in str(err.value) and repr(key) in str(err.value)
    assert err.value.accumulator == key
    assert isinstance(err.value, ValueError)
    with pytest.raises(osn.UnsupportedOptimizerStateError, match="ema"):
        osc.create_optimizer_state(_AdamWithEma(parameters=Dense().parameters()))


def test_subclass_adding_nothing_is_accepted() -> None:
    model = Dense()
    opt = _PlainAdamSubclass(0.01, parameters=model.parameters())
    _train(model, opt, _batches(1))
    assert osn.accumulator_table(opt) == {k: k for k in ADAM} | {"moment2_max": "moment2_max"}
    assert len(osn.optimizer_state_entries(opt, model.fc.weight)) == 4


def test_known_accumulator_with_foreign_shape_is_refused() -> None:
    model = Dense()
    opt = _AdamWithOddMoment(0.01, parameters=model.parameters())
    osc.create_optimizer_state(opt)
    with pytest.raises(osn.UnsupportedOptimizerStateError, match="_AdamWithOddMoment.*moment1"):
        osn.optimizer_state_entries(opt, model.fc.weight)


def test_unknown_optimizer_class_is_refused() -> None:
    model = Dense()
    with pytest.raises(osn.UnsupportedOptimizerStateError, match="LBFGS"):
        osn.accumulator_table(O.LBFGS(parameters=model.parameters()))

    class Custom(paddle.optimizer.Optimizer):
        pass

    custom = Custom(0.1, parameters=model.parameters())
    for call in (
        lambda: osn.optimizer_state_entries(custom, model.fc.weight),
        lambda: osc.create_optimizer_state(custom),
        lambda: osj.optimizer_global_state(custom),
    ):
        with pytest.raises(osn.UnsupportedOptimizerStateError, match="Custom"):
            call()


def test_table_matches_the_classes_accumulator_strings() -> None:
    """Catch a paddle upgrade renaming or adding an accumulator string."""
    for cls in [
        O.Adam, O.AdamW, O.Adamax, O.RMSProp, O.Adadelta, O.NAdam, O.RAdam,
        O.Momentum, O.Lamb, O.Adagrad, O.ASGD, O.Rprop, O.SGD,
    ]:  # fmt: skip
        declared = {getattr(cls, a) for a in dir(cls) if "_acc" in a and a.endswith("_str")}
        opt = cls(0.01, parameters=Dense().parameters())
        assert set(osn.accumulator_table(opt)) == declared, cls.__name__
        assert set(osn.accumulator_kinds(opt)) == declared


class _FleetLikeWrapper:
    """Mimics HybridParallelOptimizer: forwards every attribute."""

    def __init__(self, optimizer) -> None:
        self._inner_opt = optimizer

    def __getattr__(self, item):
        return getattr(self._inner_opt, item)


def test_wrapped_optimizers_are_unwrapped() -> None:
    from paddle.distributed.fleet.utils.mix_precision_utils import (
        MixPrecisionOptimizer,
    )

    model = Dense()
    inner = O.AdamW(0.01, parameters=model.parameters(), name="opt")
    wrapped = _FleetLikeWrapper(MixPrecisionOptimizer(inner))
    assert osn.unwrap_optimizer(wrapped) is inner
    osc.create_optimizer_state(wrapped)
    entries = osn.optimizer_state_entries(wrapped, model.fc.weight)
    assert [e.tensor for e in entries] == [e.tensor for e in osn.optimizer_state_entries(inner, model.fc.weight)]
    assert osj.optimizer_global_state(wrapped)["optimizer_class"] == "AdamW"

    with pytest.raises(TypeError):
        osn.unwrap_optimizer(object())


def test_wrapper_with_own_state_is_refused() -> None:
    model = Dense()
    outer = O.Adam(0.01, parameters=model.parameters())
    _train(model, outer, _batches(1))
    outer._inner_opt = O.SGD(0.01, parameters=model.parameters())
    with pytest.raises(osn.UnsupportedOptimizerStateError, match="own"):
        osn.unwrap_optimizer(outer)


def test_all_entries_refuse_state_of_unlisted_params() -> None:
    model = Dense()
    opt = O.Adam(0.01, parameters=model.parameters())
    _train(model, opt, _batches(1))
    with pytest.raises(osn.UnsupportedOptimizerStateError, match="none of the given params"):
        osn.all_optimizer_state_entries(opt, [model.fc.weight])


@pytest.mark.parametrize(
    "make_scheduler,step",
    [
        (lambda: L.CosineAnnealingWarmRestarts(0.1, T_0=2, T_mult=2), None),
        (lambda: L.ReduceOnPlateau(0.1, patience=1), "metric"),
        (
            lambda: L.LinearWarmup(L.StepDecay(0.1, 2), 3, 0.0, 0.1),
            None,
        ),
        (lambda: L.OneCycleLR(0.1, total_steps=20), None),
    ],
    ids=["warm_restarts", "reduce_on_plateau", "linear_warmup", "one_cycle"],
)
def test_scheduler_state_round_trips_through_strict_json(make_scheduler, step) -> None:
    def advance(sched, i):
        if step == "metric":
            sched.step(float(3 - i % 2))
        else:
            sched.step()

    model = Dense()
    opt_a = O.SGD(make_scheduler(), parameters=model.parameters())
    for i in range(5):
        advance(opt_a._learning_rate, i)
    state = json.loads(json.dumps(osj.optimizer_global_state(opt_a), allow_nan=False))
    opt_b = O.SGD(make_scheduler(), parameters=model.parameters())
    _set_global_state(opt_b, state)
    lrs_a, lrs_b = [], []
    for i in range(5, 12):
        advance(opt_a._learning_rate, i)
        advance(opt_b._learning_rate, i)
        lrs_a.append(opt_a.get_lr())
        lrs_b.append(opt_b.get_lr())
    assert lrs_a == lrs_b


def test_global_state_refuses_mismatches() -> None:
    model = Dense()
    state = osj.optimizer_global_state(O.Adam(0.01, parameters=model.parameters()))
    assert state["learning_rate"] == {"type": "float", "value": 0.01}
    with pytest.raises(ValueError, match="AdamW"):
        _set_global_state(O.AdamW(0.01, parameters=model.parameters()), state)
    with pytest.raises(ValueError, match="StepDecay"):
        _set_global_state(O.Adam(L.StepDecay(0.1, 2), parameters=model.parameters()), state)


def test_copy_into_state_checks_shape_and_dtype_and_keeps_identity() -> None:
    t = paddle.zeros([3])
    ptr = t.data_ptr()
    osc.copy_into_state_(t, paddle.ones([3]))
    assert t.data_ptr() == ptr and t.numpy().tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="shape"):
        osc.copy_into_state_(t, paddle.ones([4]))
    with pytest.raises(ValueError, match="int64"):
        osc.copy_into_state_(t, paddle.ones([3], dtype="int64"))


def test_non_finite_scheduler_values_survive_strict_json() -> None:
    model = Dense()
    opt_a = O.SGD(L.ReduceOnPlateau(0.1), parameters=model.parameters())
    opt_a._learning_rate.best = float("-inf")
    text = json.dumps(osj.optimizer_global_state(opt_a), allow_nan=False)
    opt_b = O.SGD(L.ReduceOnPlateau(0.1), parameters=model.parameters())
    _set_global_state(opt_b, json.loads(text))
    assert opt_b._learning_rate.best == float("-inf")
