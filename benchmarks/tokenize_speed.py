"""How long the trial takes to tokenize a text data set with the model's tokenizer.

Baseline, by name: "one tokenizer call a record" (the path before: each document encoded on its
own, its ids copied one by one). Measured: ``capture.trial.build.data.tokenize`` as the trial
runs it (a batch of documents a call, which a fast tokenizer encodes on every core). Both run
here, one after the other (with --rounds 2, a second pair in reverse order), on the same records;
the ids must be equal (else exit 1). The ratio is baseline / now.

    python benchmarks/tokenize_speed.py                              # a BPE trained here, 20,000 documents
    python benchmarks/tokenize_speed.py --tokenizer MODEL_DIR --records 100000
    python benchmarks/tokenize_speed.py --format chat                # conversations, the chat template
    python benchmarks/tokenize_speed.py --quick                      # CI: 2,000 documents
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's tokenizer trainer: one piece for both

BASELINE_NAME = "one tokenizer call a record"


def _baseline(tok, records, chat: bool):
    out = []
    for rec in records:
        encoded = tok.apply_chat_template(rec, tokenize=True, return_dict=True) if chat else \
            tok(rec, add_special_tokens=False)
        out.append(array("q", [int(x) for x in encoded["input_ids"]]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="a folder with a model's tokenizer files (default: a BPE trained here)")
    ap.add_argument("--records", type=int, default=20000, help="documents (default 20,000)")
    ap.add_argument("--format", choices=("text", "chat"), default="text",
                    help="chat: two-turn conversations rendered with the chat template")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2,000 documents, one round (CI)")
    args = ap.parse_args(argv)
    if args.quick:
        args.records, args.rounds = 2000, 1

    from transformers import AutoTokenizer

    from capture.trial.build import data
    from capture.trial.config import load_example

    docs = [d for d in data.corpus_text().split("\n\n") if d.strip()]
    with tempfile.TemporaryDirectory(prefix="tokenize-speed-") as tmp:
        folder = Path(args.tokenizer) if args.tokenizer else Path(tmp)
        if not args.tokenizer:
            from tiny_tokenizer import save_tiny_tokenizer

            save_tiny_tokenizer(folder, docs, vocab_size=2000, chat=args.format == "chat")
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        rng = random.Random(0)
        records: list = [" ".join(rng.choice(docs) for _ in range(8)) for _ in range(args.records)]
        if args.format == "chat":
            records = [[{"role": "user", "content": rng.choice(docs)}, {"role": "assistant", "content": r}]
                       for r in records]
        example = load_example("tiny")
        config = dataclasses.replace(example, data=dataclasses.replace(example.data, tokenizer="model", format=args.format))
        times: dict[str, list[float]] = {"baseline": [], "now": []}
        for r in range(args.rounds):
            for which in (("baseline", "now") if r % 2 == 0 else ("now", "baseline")):
                t0 = time.perf_counter()
                if which == "baseline":
                    base = _baseline(tok, records, args.format == "chat")
                else:
                    now = data.tokenize(config, records, len(tok), folder, {})[0].ids
                times[which].append(time.perf_counter() - t0)
        if base != now:
            print("tokenize_speed: the ids differ from the baseline's", file=sys.stderr)
            return 1
    b, n = min(times["baseline"]), min(times["now"])
    tokens = sum(len(x) for x in now)
    print(f"{len(records):,} {'conversations' if args.format == 'chat' else 'documents'}, {tokens:,} tokens; "
          f"{os.cpu_count()} cores; {type(tok).__name__}; best of {args.rounds}")
    print(f"baseline ({BASELINE_NAME}): {b:.2f} s   now (a batch a call): {n:.2f} s   "
          f"ratio against the baseline: {b / n:.2f}x   ids equal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
