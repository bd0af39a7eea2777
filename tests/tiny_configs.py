"""The tiny GPT-2 that CPU trials are built from (256 byte tokens and one special), one helper for
every test that writes a trial config by hand."""

from __future__ import annotations


def gpt2_model(n_positions: int = 32, n_embd: int = 32, n_layer: int = 1, n_head: int = 2,
               dropout: float | None = None, specials: bool = True, blank_lines: bool = False) -> str:
    """``[trial.model]`` and ``[trial.model.config]`` of a GPT-2 shape built from its config.
    ``dropout``: residual, embedding and attention dropout (what makes a restore need the RNG);
    ``specials``: token 256 as BOS and EOS."""
    config = ["vocab_size = 257", f"n_positions = {n_positions}", f"n_embd = {n_embd}", f"n_layer = {n_layer}",
              f"n_head = {n_head}"]
    if dropout is not None:
        config += [f"{k}_pdrop = {dropout}" for k in ("resid", "embd", "attn")]
    if specials:
        config += ["bos_token_id = 256", "eos_token_id = 256"]
    gap = "\n\n" if blank_lines else "\n"
    return ('[trial.model]\nsource = "from_config"\narchitecture = "gpt2"' + gap
            + "[trial.model.config]\n" + "\n".join(config) + "\n")
