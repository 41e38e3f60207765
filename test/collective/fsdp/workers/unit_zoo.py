"""A zoo of unit forwards: each wrapped model must match the same model in one process.

Every case builds a small float64 model whose ``Unit`` layers are FSDP units, trains it two steps with SGD
on the same full batch on every rank (so the mean over ranks equals the one-process gradient), and compares
losses, every gradient piece and the final parameters with an unwrapped copy. Run directly (one process) or
under run_launch; each rank reports {case: "ok" | traceback}.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections import namedtuple

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import recompute

DIM = 6
Pair = namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class UnitOutput:
    hidden: paddle.Tensor
    aux: paddle.Tensor | None = None
    count: int = 0


class Unit(paddle.nn.Layer):
    """One Linear and a configurable ending."""

    def __init__(self, ending: str) -> None:
        super().__init__()
        self.fc = paddle.nn.Linear(DIM, DIM)
        self.fc2 = paddle.nn.Linear(DIM, DIM)
        self.ending = ending

    def forward(self, x):
        h = self.fc(x)
        e = self.ending
        if e in ("tanh", "sigmoid", "exp"):
            return getattr(paddle, e)(h)
        if e == "softmax":
            return F.softmax(h, axis=-1)
        if e == "tuple":
            return paddle.tanh(h), F.sigmoid(self.fc2(x))
        if e == "list":
            return [paddle.tanh(h), self.fc2(x)]
        if e == "namedtuple":
            return Pair(paddle.tanh(h), self.fc2(x))
        if e == "dict":
            return {"hidden": paddle.tanh(h), "aux": self.fc2(x), "none": None, "n": 3}
        if e == "dataclass":
            return UnitOutput(F.softmax(h, axis=-1), paddle.exp(self.fc2(x) * 0.1), count=2)
        if e == "input_passthrough":
            return x, paddle.tanh(h)
        if e == "input_view":
            return x.reshape([-1]), x[:, :2], paddle.tanh(h)
        if e == "stop_gradient_output":
            return paddle.tanh(h).detach(), F.sigmoid(self.fc2(x))
        if e == "unsupported":
            return _Opaque(paddle.tanh(h))
        return h


class _Opaque:
    def __init__(self, tensor) -> None:
        self.tensor = tensor


class Inner(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.fc = paddle.nn.Linear(DIM, DIM)

    def forward(self, x):
        return paddle.tanh(self.fc(x))


class Outer(paddle.nn.Layer):
    """A unit holding a unit (nested units): its own Linear after the inner unit, softmax at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.fc = paddle.nn.Linear(DIM, DIM)

    def forward(self, x):
        return F.softmax(self.fc(self.inner(x)), axis=-1)


def _first(out):
    """The differentiable main tensor of any unit output, combined with the rest so every part matters."""
    if isinstance(out, paddle.Tensor):
        return out
    if isinstance(out, dict):
        return out["hidden"] + out["aux"]
    if isinstance(out, UnitOutput):
        return out.hidden + out.aux
    if isinstance(out, (tuple, list)):
        total = out[-1]
        for part in out[:-1]:
            if part.shape == total.shape:
                total = total + part
        return total
    raise TypeError(type(out))


class Model(paddle.nn.Layer):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.embed = paddle.nn.Linear(DIM, DIM)
        ending = {
            "used_twice": "tanh",
            "called_twice": "tanh",
            "recurrence": "sigmoid",
            "no_grad_eval": "tanh",
            "recompute_nonreentrant": "softmax",
        }
        if case == "nested":
            self.unit = Outer()
        else:
            self.unit = Unit(ending.get(case, case.replace("recompute_", "")))
        self.head = paddle.nn.Linear(DIM, 1)

    def forward(self, x):
        h = self.embed(x)
        if self.case == "used_twice":
            y = self.unit(h)
            return (self.head(y) * y.mean(axis=-1, keepdim=True)).mean() + (y * y).mean()
        if self.case == "called_twice":
            y = self.unit(self.unit(h))
        elif self.case == "recurrence":
            y = h
            for _ in range(3):
                y = self.unit(y) + h
        elif self.case == "recompute_nonreentrant":
            y = _first(recompute(self.unit, h, use_reentrant=False))
        elif self.case.startswith("recompute_"):
            y = _first(recompute(self.unit, h, use_reentrant=True))
        else:
            y = _first(self.unit(h))
        return self.head(y).mean()


CASES = [
    "tanh",
    "sigmoid",
    "softmax",
    "exp",
    "tuple",
    "list",
    "namedtuple",
    "dict",
    "dataclass",
    "input_passthrough",
    "input_view",
    "used_twice",
    "stop_gradient_output",
    "called_twice",
    "recurrence",
    "nested",
    "no_grad_eval",
    "recompute_tanh",
    "recompute_tuple",
    "recompute_nonreentrant",
]


def _batches():
    rng = np.random.default_rng(7)
    return [paddle.to_tensor(rng.standard_normal((5, DIM))) for _ in range(2)]


def _grad_pieces_match(fsdp, reference: paddle.nn.Layer) -> None:
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    for key, param, buffer, index in fsdp.managed_parameters():
        piece = buffer.pieces.get(index)
        if piece is None:
            continue
        expected = ref_grads[key]
        got = param.grad
        if expected is None:
            assert got is None or float(got.abs().max()) == 0.0, f"{key}: gradient where the reference has none"
            continue
        assert got is not None, f"{key}: no gradient"
        want = expected.numpy().reshape([-1])[piece.param_start : piece.param_stop]
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-12, err_msg=key)


def run_case(case: str) -> None:
    from paddle.distributed.fsdp import FullyShardFusion

    paddle.set_default_dtype("float64")
    try:
        paddle.seed(11)
        model = Model(case)
        paddle.seed(11)
        reference = Model(case)
        units = ["Outer", "Inner"] if case == "nested" else ["Unit"]
        fsdp = FullyShardFusion(model, fsdp_unit_layers=units)
        opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
        ref_opt = paddle.optimizer.SGD(0.1, parameters=reference.parameters())
        for x in _batches():
            if case == "no_grad_eval":
                with paddle.no_grad():
                    got, want = model(x), reference(x)
                np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)
            loss, ref_loss = model(x), reference(x)
            np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-12)
            loss.backward()
            ref_loss.backward()
            _grad_pieces_match(fsdp, reference)
            opt.step()
            ref_opt.step()
            opt.clear_grad()
            ref_opt.clear_grad()
        full = fsdp.full_parameters()
        for key, value in reference.named_parameters():
            np.testing.assert_allclose(full[key].numpy(), value.numpy(), rtol=1e-10, atol=1e-12, err_msg=key)
    finally:
        paddle.set_default_dtype("float32")


def unsupported_output_is_named() -> None:
    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.step.hooks import UnsupportedUnitOutputError

    paddle.seed(1)
    model = Model("unsupported")
    FullyShardFusion(model, fsdp_unit_layers=["Unit"])
    try:
        model.unit(paddle.randn([2, DIM]))
    except UnsupportedUnitOutputError as e:
        assert "unit (Unit)" in str(e) and "_Opaque" in str(e), str(e)
    else:
        raise AssertionError("an opaque unit output was accepted")
    with paddle.no_grad():  # evaluation needs no backward: accepted
        model.unit(paddle.randn([2, DIM]))


def run_all() -> dict:
    out = {}
    for case in CASES:
        try:
            run_case(case)
            out[case] = "ok"
        except Exception:  # noqa: BLE001 - reported per case
            out[case] = traceback.format_exc()
    try:
        unsupported_output_is_named()
        out["unsupported"] = "ok"
    except Exception:  # noqa: BLE001
        out["unsupported"] = traceback.format_exc()
    return out


def main() -> None:
    import paddle.distributed as dist
    from launch_util import report

    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    results = run_all()
    report(results)
    bad = [k for k, v in results.items() if v != "ok"]
    if bad:
        print({k: results[k] for k in bad}, file=sys.stderr)


if __name__ == "__main__":
    main()
