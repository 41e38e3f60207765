"""peft's side of test_fsdp_trainer_lora.py::test_peft_loads_the_adapter, run by an interpreter with torch + peft.

``python peft_load.py ADAPTER_DIR CHECK.npz``: builds HF transformers' ``LlamaForCausalLM`` from the merged export's
``config.json`` with the base weights in CHECK.npz (``base/<key>``, HF layout), loads ADAPTER_DIR with
``peft.PeftModel.from_pretrained``, and checks that peft's ``lora_A``/``lora_B`` equal PaddleFormers' (``lora/<key>``,
Paddle's ``[in, out]`` orientation) bit for bit and that the logits on ``ids`` equal PaddleFormers' LoRAModel's
(``logits``) within 1e-5. Kept apart from the test because torch and Paddle need not share a venv.
"""

import sys

import numpy as np
import torch
from peft import PeftModel
from transformers import LlamaConfig, LlamaForCausalLM


def main(adapter_dir: str, check: str) -> None:
    ref = np.load(check)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(f"{adapter_dir}/merged")).eval()
    model.load_state_dict({k[len("base/") :]: torch.from_numpy(ref[k]) for k in ref.files if k.startswith("base/")})
    ids = torch.from_numpy(ref["ids"])
    with torch.no_grad():  # the same base first: a logits mismatch below is then the adapter's
        np.testing.assert_allclose(model(input_ids=ids).logits.numpy(), ref["base_logits"], rtol=0, atol=1e-5)
    peft_model = PeftModel.from_pretrained(model, adapter_dir).eval()
    got = {k: v.detach().numpy() for k, v in peft_model.state_dict().items() if ".lora_" in k}
    want = {k[len("lora/model.") :]: ref[k] for k in ref.files if k.startswith("lora/")}
    assert len(got) == len(want) > 0, (sorted(got), sorted(want))
    for key, value in want.items():
        module, which = key.rsplit(".", 1)
        np.testing.assert_array_equal(got[f"base_model.model.{module}.{which}.default.weight"], value.T, err_msg=key)
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(logits, ref["logits"], rtol=0, atol=1e-5)
    print(f"peft loaded {len(got)} adapter tensors; logits max diff {np.abs(logits - ref['logits']).max():.3g}")


if __name__ == "__main__":
    main(*sys.argv[1:])
