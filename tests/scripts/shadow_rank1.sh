#!/bin/sh
# Rank 1 sees a fake tqdm-0.0.1.dist-info first on its path: its stack differs in one package.
if [ "$RANK" = "1" ]; then export PYTHONPATH="$SHADOW_DIR${PYTHONPATH:+:$PYTHONPATH}"; fi
exec "$PYTHON" "$@"
