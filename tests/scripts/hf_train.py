"""A tiny Hugging Face Trainer fine-tune with capture's callback (CPU; no downloads).

    python tests/scripts/hf_train.py OUT.toml WORKDIR        (or under torchrun)
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from integrations_helpers import tiny_gpt2  # noqa: E402


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
    out, workdir = argv[0], argv[1]
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=workdir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=6, logging_steps=2, eval_strategy="steps", eval_steps=3, save_strategy="steps",
                             save_steps=3, report_to="none", disable_tqdm=True, use_cpu=True,
                             include_num_input_tokens_seen=True, dataloader_num_workers=0)
    callback = CaptureCallback(out, warmup_steps=1, trackers=trackers)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=RandomTokens(64), eval_dataset=RandomTokens(4),
                      callbacks=[callback])
    trainer.train()
    print("manifest:", callback.manifest_path)
    return callback


if __name__ == "__main__":
    main(sys.argv[1:])
