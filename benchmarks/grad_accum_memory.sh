#!/usr/bin/env bash
# The memory estimate under gradient accumulation against the device, side by side: the same
# config at grad_accum 1 and 4 (each a short `capture trial`: no preflight, no recovery, no
# report), for the 1B example (a full fine-tune, fp32 weights under bf16 autocast) and the 8B full
# fine-tune example (bf16 weights, gradient checkpointing). Prints, per run, the estimate's peak of
# allocated tensors and device total beside the allocator's and NVML's figures and their errors.
#
#   bash benchmarks/grad_accum_memory.sh [OUT] [NAMES]     # NAMES: default "1b-ga1 1b-ga4 8b-ga1 8b-ga4"
set -euo pipefail
OUT=${1:-grad-accum-memory}
NAMES=${2:-"1b-ga1 1b-ga4 8b-ga1 8b-ga4"}
CAPTURE=${CAPTURE:-python3 -m capture}
EX=capture/trial/examples
CONFIGS=$(mktemp -d)
trap 'rm -rf "$CONFIGS"' EXIT
mkdir -p "$OUT"
for name in $NAMES; do
    case $name in
        1b-ga*) from=llama-1b ;;
        8b-ga*) from=llama-3.1-8b-full ;;
        *) echo "unknown run $name" >&2; exit 2 ;;
    esac
    ga=${name##*-ga}
    sed -e "s|^config_file = \"llama-3.1-8b/config.json\"|config_file = \"$PWD/$EX/llama-3.1-8b/config.json\"|" \
        -e "0,/^name = /s|^name = .*|name = \"$name\"|" -e "s/^grad_accum = .*/grad_accum = $ga/" \
        "$EX/$from.toml" > "$CONFIGS/$name.toml"
    grep -q "^grad_accum = $ga$" "$CONFIGS/$name.toml"
    echo "== $name ($(date -u +%H:%M:%S))"
    # shellcheck disable=SC2086  # TRIAL_FLAGS: words on purpose
    $CAPTURE trial "$CONFIGS/$name.toml" -o "$OUT/$name.toml" --warmup 1 --steps 3 --no-preflight --no-recovery \
        --no-report ${TRIAL_FLAGS:-} > /dev/null || echo "!! $name exited $?"
done
python3 - "$OUT" $NAMES <<'PY'
import sys, tomllib
from pathlib import Path
GIB = 2**30
print(f"{'run':<8}{'grad_accum':>11}{'est alloc':>11}{'alloc':>9}{'err':>8}{'est total':>11}{'device':>9}{'err':>8}  gradients term")
for name in sys.argv[2:]:
    f = Path(sys.argv[1]) / f"{name}.toml"
    if not f.exists():
        print(f"{name:<8} no manifest")
        continue
    t = tomllib.loads(f.read_text())["trial"]
    est, meas = t["memory"]["estimate"], t["memory"]["measured"]
    ea, ma = est["allocator_bytes"], meas.get("peak_allocated_bytes")
    et, md = est["total_bytes"], meas.get("device_used_bytes")
    err = lambda e, m: f"{(e - m) / m * 100:+.1f}%" if m else "-"
    print(f"{name:<8}{t['run']['grad_accum']:>11}{ea / GIB:>11.2f}{(ma or 0) / GIB:>9.2f}{err(ea, ma):>8}"
          f"{et / GIB:>11.2f}{(md or 0) / GIB:>9.2f}{err(et, md):>8}  {est['gradients']['bytes'] / GIB:.2f} GiB")
PY
