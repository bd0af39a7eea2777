#!/usr/bin/env bash
# Issue 22's reference trials on one GPU: Llama-3.1-8B from its real config.json, each setting a
# signed manifest with its HTML report, written under OUT (default ./reference-trials):
#   full-gc         full fine-tune, bf16, gradient checkpointing          (llama-3.1-8b-full)
#   lora-gc         LoRA r16, checkpointing                               (llama-3.1-8b-lora)
#   lora-nogc       LoRA r16, no checkpointing, micro-batch 2
#   qlora-gc        QLoRA nf4, checkpointing                              (llama-3.1-8b-qlora; needs bitsandbytes)
#   lora-chunked-8k LoRA r16, checkpointing, chunked loss, 1 x 8192 tokens
# Each runs the whole trial (estimate, steps, validation, checkpoint, fit, recovery); the recovery
# stage is skipped for lora-nogc and lora-chunked-8k to keep the set within 10 minutes of device
# time. Then: add the key's allowed-signers line to manifests/.capture/allowed_signers, pin the
# manifests (`capture pin`), and `capture decide manifests` ranks them in separate groups.
#
#   bash benchmarks/reference_trials.sh [OUT] [KEY]
#   ONLY="lora-gc qlora-gc" bash benchmarks/reference_trials.sh   # a subset, in this order (e.g. one per device call)
#   ESTIMATE_ONLY=1 bash benchmarks/reference_trials.sh   # no GPU: each config's `capture estimate` on an H200
#   TRIAL_FLAGS="--workdir /big/disk" bash benchmarks/reference_trials.sh   # flags for every trial (a full
#                          fine-tune's recovery writes two 45 GB checkpoints where --workdir points)
# OUT gets two files per setting (manifest, report). Where only a few files come back from the
# machine (the lent GPU returns eight per call), tar OUT into one file before the call ends.
set -euo pipefail
OUT=${1:-reference-trials}
KEY=${2:-$OUT/signer}
CAPTURE=${CAPTURE:-python3 -m capture}
EX=capture/trial/examples
CONFIGS=$(mktemp -d)  # each manifest holds its config verbatim (trial.config_toml): OUT keeps results only
trap 'rm -rf "$CONFIGS"' EXIT
mkdir -p "$OUT"
[ -n "${ESTIMATE_ONLY:-}" ] || [ -f "$KEY" ] || $CAPTURE keygen -o "$KEY" -C "reference-trials@$(hostname)"

variant() {  # variant NAME FROM [sed expressions...]: a config beside the examples' config.json
    local name=$1 from=$2
    shift 2
    local file="$CONFIGS/$name.toml"
    sed -e "s|^config_file = \"llama-3.1-8b/config.json\"|config_file = \"$PWD/$EX/llama-3.1-8b/config.json\"|" \
        -e "0,/^name = /s|^name = .*|name = \"$name\"|" "$@" "$EX/$from.toml" > "$file"
    echo "$file"
}

run() {  # run NAME CONFIG [flags...]
    local name=$1 cfg=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S))"
    if [ -n "${ESTIMATE_ONLY:-}" ]; then
        $CAPTURE estimate "$cfg" --card H200 | tail -n 8
        return
    fi
    # shellcheck disable=SC2086  # TRIAL_FLAGS: words on purpose
    $CAPTURE trial "$cfg" --key "$KEY" -o "$OUT/$name.toml" "$@" ${TRIAL_FLAGS:-} || echo "!! $name exited $?"
}

config() {  # config NAME: the setting's config file, then its extra flags (one per line)
    case $1 in
        full-gc) variant full-gc llama-3.1-8b-full ;;
        lora-gc) variant lora-gc llama-3.1-8b-lora ;;
        lora-nogc) variant lora-nogc llama-3.1-8b-lora -e 's/^gradient_checkpointing = true/gradient_checkpointing = false/' \
            -e 's/^micro_batch_size = 4/micro_batch_size = 2/'; echo --no-recovery ;;
        qlora-gc) variant qlora-gc llama-3.1-8b-qlora ;;
        lora-chunked-8k) variant lora-chunked-8k llama-3.1-8b-lora \
            -e 's/^gradient_checkpointing = true/gradient_checkpointing = true\nloss = "chunked"/' \
            -e 's/^max_seq_len = 2048/max_seq_len = 8192/' -e 's/^micro_batch_size = 4/micro_batch_size = 1/'
            echo --no-recovery ;;
        *) echo "unknown setting: $1" >&2; return 2 ;;
    esac
}

# In the order ONLY names them (the most wanted first, when a device call may run out of time).
for name in ${ONLY:-full-gc lora-gc lora-nogc qlora-gc lora-chunked-8k}; do
    mapfile -t lines < <(config "$name")
    run "$name" "${lines[@]}"
done
ls -l "$OUT"
