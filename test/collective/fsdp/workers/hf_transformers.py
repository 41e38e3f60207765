"""The consumer side of the preset tests: Hugging Face transformers on torch (CPU, fp32). Never imports paddle.

Usage: hf_transformers.py logits CASES_JSON
         for every case {"hf_dir", "ids", "out"}: AutoModelForCausalLM.from_pretrained(hf_dir) (a load that
         leaves any weight newly initialised or unused is an error), logits on `ids` -> `out` (.npy).
       hf_transformers.py save CASES_JSON
         for every case {"config", "out_dir", "ids", "out", "seed"}: a transformers model of `config` with seeded
         random weights, save_pretrained(out_dir) (safetensors), its logits on `ids` -> `out`.
Prints one JSON line {name: "ok" | traceback}.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np
import torch
import transformers


def _logits(model, ids_path: str) -> np.ndarray:
    ids = torch.from_numpy(np.load(ids_path))
    with torch.no_grad():
        return model(input_ids=ids).logits.float().numpy()


def logits_case(case: dict) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        case["hf_dir"], torch_dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise AssertionError(f"transformers loaded {case['hf_dir']} with {bad}")
    model.eval()
    np.save(case["out"], _logits(model, case["ids"]))


def save_case(case: dict) -> None:
    with open(case["config"]) as f:
        config = transformers.AutoConfig.for_model(**json.load(f))
    torch.manual_seed(case["seed"])
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.eval()
    model.save_pretrained(case["out_dir"], safe_serialization=True)
    np.save(case["out"], _logits(model, case["ids"]))


def main() -> None:
    mode, cases_path = sys.argv[1], sys.argv[2]
    with open(cases_path) as f:
        cases = json.load(f)
    results = {}
    for case in cases:
        try:
            (logits_case if mode == "logits" else save_case)(case)
            results[case["name"]] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test
            results[case["name"]] = traceback.format_exc()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
