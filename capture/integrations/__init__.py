"""Where users already train: framework callbacks and trackers over :class:`capture.Recorder`.

- :mod:`capture.integrations.hf`: a ``transformers.TrainerCallback`` (extra ``capture-stack[hf]``).
- :mod:`capture.integrations.lightning`: a Lightning ``Callback`` (extra ``capture-stack[lightning]``).
- :mod:`capture.integrations.trackers`: the signed manifest and step scalars to MLflow, W&B and
  TensorBoard (extra ``capture-stack[trackers]``).
- :mod:`capture.integrations.distributed`: the rank-0 gather behind ``Recorder.write_manifest``.
- :mod:`capture.integrations.exec_side`: how a Recorder hands its figures to ``capture exec``.

Each framework is imported only by the module that needs it.
"""
