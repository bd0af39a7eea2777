"""A real (byte-level BPE) tokenizer trained by the test, saved with save_pretrained: the files a
pretrained model folder holds, without any download. One helper for every test that needs one."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_tokenizer(folder: Path, texts: Iterable[str], vocab_size: int = 300, chat: bool = False) -> None:
    """Train a byte-level BPE of at most ``vocab_size`` tokens on ``texts`` and save it in ``folder``;
    ``chat`` adds a pad token, the ChatML markers and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "</s>"] if chat else ["<unk>", "<eot>"]
    tok.train_from_iterator(list(texts), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if chat:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
        fast.chat_template = CHAT_TEMPLATE
    else:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eot>", unk_token="<unk>")
    fast.save_pretrained(folder)
