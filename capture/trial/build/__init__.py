"""The parts of the user's run, each where its effect lives and beside its memory term:
``model`` (source, attention, quantization, checkpointing, LoRA), ``optim``, ``data``, ``loss``,
and ``terms`` (the estimate's terms, one function per part). ``capture.trial.workload`` assembles them."""
