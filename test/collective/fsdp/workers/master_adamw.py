"""A test optimizer that steps fp32 master weights the way paddle's GPU multi-precision AdamW kernel does.

Why: on CPU stock paddle has no bf16 AdamW kernel, and its bf16 SGD kernel never updates the fp32 master
weight, so master-weight checkpoint tests would otherwise round-trip a constant. This one does the
kernel's arithmetic with paddle ops, in fp32 on the master weight, then casts master -> parameter:

    master *= 1 - lr * coeff                      (decoupled decay, when the parameter is decayed)
    m1 = beta1 * m1 + (1 - beta1) * g ;  m2 = beta2 * m2 + (1 - beta2) * g * g      (g = fp32 gradient)
    master -= lr / (1 - beta1^t) * m1 / (sqrt(m2) / sqrt(1 - beta2^t) + eps)
    param = cast(master, param dtype) ;  beta1^t *= beta1 ;  beta2^t *= beta2

It subclasses AdamW, so its state (moment1/2, beta pows, master_weight) is AdamW's and checkpoints map it.
"""

from __future__ import annotations

import paddle


class MasterAdamW(paddle.optimizer.AdamW):
    def _append_optimize_op(self, block, param_and_grad):
        if isinstance(param_and_grad, dict):
            param_and_grad = self._update_param_group(param_and_grad)
        param, grad = param_and_grad
        decay = self._apply_decay_param_fun is None or self._apply_decay_param_fun(param.name)
        m1 = self._get_accumulator_master(self._moment1_acc_str, param)
        m2 = self._get_accumulator_master(self._moment2_acc_str, param)
        b1p = self._get_accumulator_master(self._beta1_pow_acc_str, param)
        b2p = self._get_accumulator_master(self._beta2_pow_acc_str, param)
        has_master = self._multi_precision and self._is_dtype_fp16_or_bf16(param.dtype)
        master = self._master_weights[param.name] if has_master else param
        lr = self._create_param_lr(param_and_grad).astype("float32")
        beta1, beta2, eps = float(self._beta1), float(self._beta2), float(self._epsilon)
        with paddle.no_grad():
            g = grad.astype("float32")
            p = master.astype("float32")
            if decay:
                p = p * (1.0 - lr * self._weight_decay)
            new_m1 = m1 * beta1 + g * (1.0 - beta1)
            new_m2 = m2 * beta2 + g * g * (1.0 - beta2)
            denom = paddle.sqrt(new_m2) / paddle.sqrt(1.0 - b2p) + eps
            p = p - (lr / (1.0 - b1p)) * new_m1 / denom
            paddle.assign(new_m1, output=m1)
            paddle.assign(new_m2, output=m2)
            if has_master:
                paddle.assign(p, output=master)
            paddle.assign(p.astype(param.dtype), output=param)
            paddle.assign(b1p * beta1, output=b1p)
            paddle.assign(b2p * beta2, output=b2p)
        return None
