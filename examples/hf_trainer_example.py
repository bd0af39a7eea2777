"""A Hugging Face Trainer fine-tune recorded by capture's callback (a tiny GPT-2; CPU or GPU).

    python examples/hf_trainer_example.py [OUT.toml [WORKDIR]]
    torchrun --nproc-per-node 2 examples/hf_trainer_example.py run.toml work   # every rank records, rank 0 writes

Writes OUT.toml (signed with your default key) and OUT.html. Needs `pip install 'capture-stack[hf]'`.
"""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def tiny_gpt2() -> GPT2LMHeadModel:
    """A 2-layer GPT-2 built from its config: nothing is downloaded."""
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.loss_type = "ForCausalLM"  # GPT-2 names no loss type; transformers 5 warns unless one is set
    return model


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 16, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str], trackers: tuple = ()) -> object:
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging

    from capture.integrations.hf import CaptureCallback

    logging.set_verbosity_error()
    out = argv[0] if argv else "hf-trainer-example.toml"
    workdir = argv[1] if len(argv) > 1 else "hf-trainer-example-work"
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=workdir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=6, logging_steps=2, eval_strategy="steps", eval_steps=3, save_strategy="steps",
                             save_steps=3, report_to="none", disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
                             include_num_input_tokens_seen=True, dataloader_num_workers=0)
    callback = CaptureCallback(out, warmup_steps=1, trackers=trackers)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=RandomTokens(64), eval_dataset=RandomTokens(4),
                      callbacks=[callback])
    trainer.train()
    print("manifest:", callback.manifest_path)
    return callback


if __name__ == "__main__":
    main(sys.argv[1:])
    # Under torchrun: take the process group down before the interpreter does, as PyTorch asks,
    # so that pending collectives finish first (NCCL warns at exit otherwise). The framework's
    # process group outlives fit/train.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
