"""A results repository: signed manifests pinned into git, verified as a tree, compared, shown.

Modules: :mod:`~capture.results.pin` (verify, then commit into a repository atomically),
:mod:`~capture.results.index` (the index of pinned runs), :mod:`~capture.results.compare` (two
runs side by side: the verify engine's stack differences, then the trial figures),
:mod:`~capture.results.show` (one run, readable), :mod:`~capture.results.intoto` (in-toto
Statement in a DSSE envelope), :mod:`~capture.results.summary` (the facts all of them show).
Verifying many manifests at once is :mod:`capture.verify.tree`; every module here opens
manifests through :func:`capture.verify.open.open_manifest`.
"""
