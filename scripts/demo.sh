#!/usr/bin/env bash
# The sandbox demo (`make demo`): a real isolated systemd user manager running the project's own
# units, 8 simulated GPUs and a fake vLLM; kimi-supervisor.service owns vLLM's unit.
# production -> profile with a ghost planted in between -> production, then status, history
# and doctor.
# Everything it starts is stopped at the end, also on failure or Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
DIR="$(mktemp -d /tmp/kimi-demo.XXXXXX)"

# Bold headings on a terminal only: piped into a file or a pager, plain text.
if [ -t 1 ] && [ "${TERM:-dumb}" != dumb ]; then BOLD=$'\033[1m' PLAIN=$'\033[0m'; else BOLD= PLAIN=; fi
step() { printf '\n%s== %s%s\n' "$BOLD" "$*" "$PLAIN"; }
cleanup() {
  step "cleaning up: kimi-supervisor sandbox down --dir $DIR"
  "$BIN/kimi-supervisor" sandbox down --dir "$DIR" || true
  rm -rf "$DIR"
}
trap cleanup EXIT

step "sandbox up: systemd --user, 8 simulated GPUs, kimi-supervisor.service started"
"$BIN/kimi-supervisor" sandbox up --dir "$DIR" --gpus 8 > "$DIR.env"
# shellcheck disable=SC1090
. "$DIR.env"
rm -f "$DIR.env"
systemctl --user status kimi-supervisor.service --no-pager --lines=0 || true

step "kimi-mode production: the daemon brought production up at boot"
"$BIN/kimi-mode" production

step "the incident's ghost: python3 train.py took 30 GiB on GPUs 0-3, forked a helper and died"
# NVML keeps listing the dead PID; the helper, named like nothing, holds the memory.
HELPER=$("$BIN/kimi-supervisor" sandbox ghost --dir "$DIR" --gpu 0,1,2,3 --mib 30720 \
  --title "python3 train.py" --helper "pt_data_worker")
echo "the helper holding the memory: PID $HELPER ($(cat "/proc/$HELPER/comm"))"
step "bystanders: nvtop and nvidia-persistenced have every device file open, as NVML clients do"
NVTOP=$("$BIN/kimi-supervisor" sandbox ghost --dir "$DIR" --gpu all --mib 0 --title nvtop)
PERSISTENCED=$("$BIN/kimi-supervisor" sandbox ghost --dir "$DIR" --gpu all --mib 0 \
  --title nvidia-persistenced)
"$BIN/kimi-mode" status

step "kimi-mode profile: teardown (the helper is found open-and-mapped and killed), then profile"
"$BIN/kimi-mode" profile
# The demo fails unless the ghost's helper is gone and every bystander lives.
if [ -d "/proc/$HELPER" ] && [ "$(cut -d' ' -f3 "/proc/$HELPER/stat")" != Z ]; then
  echo "DEMO FAILED: the ghost's helper PID $HELPER still runs: the teardown did not kill it" >&2
  exit 1
fi
echo "the ghost's helper PID $HELPER was killed"
for pid in "$NVTOP" "$PERSISTENCED"; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "DEMO FAILED: bystander PID $pid was killed" >&2
    exit 1
  fi
  echo "bystander PID $pid ($(cat "/proc/$pid/comm")) is still running"
done

step "kimi-mode production: back again"
"$BIN/kimi-mode" production

step "kimi-mode status"
"$BIN/kimi-mode" status

step "kimi-mode history -n 6"
"$BIN/kimi-mode" history -n 6

step "kimi-mode doctor: is this host fit to run the daemon?"
"$BIN/kimi-mode" doctor
