"""Train a tiny Llama with PaddleFormers' Trainer, sharded by FSDP (docs/trainer.md).

    pip install ".[cpu,paddleformers]"
    python -m paddle.distributed.launch --nproc_per_node 2 examples/trainer_fsdp.py --output_dir /tmp/fsdp-trainer

Everything is made here (a tiny config, a word-level tokenizer, a synthetic dataset): nothing is downloaded. The
three lines that differ from a stock Trainer script are marked "FSDP". Run it again with ``--resume`` to continue
from the newest committed checkpoint; the Hugging Face export lands in ``OUTPUT_DIR/final``. With ``--lora`` the
model is fine-tuned with PaddleFormers' LoRA (r=4 on q_proj and v_proj, the base frozen): checkpoints then hold the
adapters and a reference to the base, and ``OUTPUT_DIR/final`` the adapter (PaddleFormers' and peft's layouts).
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import paddle
from paddle.distributed.fsdp.integrations.paddleformers import FSDPTrainer  # FSDP (1 of 3)
from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments  # noqa: F401 (Trainer: the stock one)
from paddleformers.transformers import PreTrainedTokenizerFast
from paddleformers.transformers.llama.configuration import LlamaConfig
from paddleformers.transformers.llama.modeling import LlamaForCausalLM
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 128
SEQ = 32


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words w0..w123 plus 4 special tokens, built in memory."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


class CountingDataset(paddle.io.Dataset):
    """Sequences that count upwards modulo the vocabulary from a random start: learnable in a few steps."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.RandomState(seed)
        starts = rng.randint(4, VOCAB, size=n)
        self.rows = [(4 + (s - 4 + np.arange(SEQ + 1)) % (VOCAB - 4)).astype("int64") for s in starts]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        return {"input_ids": row[:-1], "labels": row[1:]}


def lora_llama() -> paddle.nn.Layer:
    """The tiny Llama under PaddleFormers' LoRA (r=4 on q_proj and v_proj), only the adapters trainable."""
    from paddleformers.peft import LoRAConfig, LoRAModel

    config = LoRAConfig(target_modules=[".*q_proj.*", ".*v_proj.*"], r=4, lora_alpha=8, merge_weights=False)
    model = LoRAModel(tiny_llama(), config)
    model.mark_only_lora_as_trainable()
    return model


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step}: loss {logs['loss']:.6f}", flush=True)


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        dtype="float32",
        fuse_rms_norm=False,  # no fused CPU kernel
    )
    paddle.seed(0)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default="/tmp/fsdp-trainer-example")
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    parser.add_argument("--lora", action="store_true", help="fine-tune LoRA adapters on q/v, the base frozen")
    opts = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    args = TrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        logging_steps=1,
        save_steps=4,
        save_total_limit=2,
        sharding="",  # FSDP (2 of 3): the Trainer's own sharding off, FSDP shards
        amp_master_grad=False,  # fp32 on CPU
        device="cpu",
        report_to="none",
        disable_tqdm=True,
        seed=42,
    )
    trainer = FSDPTrainer(  # FSDP (3 of 3): was Trainer(
        model=lora_llama() if opts.lora else tiny_llama(),
        args=args,
        train_dataset=CountingDataset(256),
        tokenizer=make_tokenizer(),
        callbacks=[PrintLoss()],
    )
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    trainer.save_model(f"{opts.output_dir}/final")


if __name__ == "__main__":
    main()
