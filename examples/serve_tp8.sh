#!/usr/bin/env bash
# Serve a DeepSeek-V3.2-style model on one 8x MI355X (gfx950) node, TP8, with the
# vllm-flydsl-indexer plugin routing the sparse indexer's decode logits to aiter's
# FlyDSL kernel. The same command with `--arm stock` serves the stock Gluon kernel.
#
# Usage:
#   examples/serve_tp8.sh [--arm flydsl|stock] [--log FILE]
#   (ARM=stock works too; the log defaults to ./vllm-serve-<arm>.log)
#
# Environment (defaults in brackets):
#   MODEL [deepseek-ai/DeepSeek-V3.2-Exp]  PORT [8000]  TP [8]  SEED [0]
#   HOST [127.0.0.1]  set 0.0.0.0 to serve other machines
#   EXTRA_SERVE_ARGS [""]  extra `vllm serve` flags, split on spaces
#   HEALTH_TIMEOUT [3600]  seconds to wait for /health
# Passed through to vLLM as they are, if you set them:
#   TUNED_CSV=FILE  an aiter-format tuned table (`vllm-flydsl-indexer tune --out FILE`),
#     passed as VLLM_FLYDSL_INDEXER_TUNED_CSV: per shape FlyDSL or stock, measured
#   VLLM_PLUGINS  if set, must include flydsl_indexer (checked before start)
#
# What it does:
#   1. flydsl arm: `vllm-flydsl-indexer doctor --strict` under the server's environment;
#      a failing gate stops here with the doctor's report.
#   2. starts, with the environment below (nothing else differs between the arms):
#        VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_FLYDSL_PAGED_MQA_LOGITS=1|0 \
#          vllm serve "$MODEL" --tensor-parallel-size 8 --seed 0
#      (no compilation flag: vLLM's own warm-up before graph capture compiles FlyDSL)
#   3. waits for /health, then checks the plugin's one line per process:
#        grep -c "FlyDSL paged MQA logits ACTIVE" "$LOG"   # flydsl: >= TP (every worker)
#   4. keeps serving until Ctrl-C (or SIGTERM), then stops the server and its workers.
#      Each shape's first call checks FlyDSL against stock (the self-test); a shape that
#      fails logs an ERROR ending "use the stock path until vLLM restarts":
#      `grep "use the stock path until vLLM restarts" "$LOG"` tells whether any fell back.
#   Before serving, `vllm-flydsl-indexer doctor --model DIR` (a model directory or type)
#   says whether the model's indexer calls the patched function at all.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$HERE/_common.sh"

usage() {
	print_usage "${BASH_SOURCE[0]}"
}

ARM="${ARM:-flydsl}"
LOG_FILE="${LOG_FILE:-}"
while (($# > 0)); do
	case "$1" in
	--arm)
		[[ $# -ge 2 ]] || die "--arm needs a value"
		ARM=$2
		shift 2
		;;
	--log)
		[[ $# -ge 2 ]] || die "--log needs a value"
		LOG_FILE=$2
		shift 2
		;;
	-h | --help)
		usage
		exit 0
		;;
	*)
		usage >&2
		die "unknown argument: $1"
		;;
	esac
done
check_arm "$ARM"
check_vllm_plugins
LOG_FILE="${LOG_FILE:-vllm-serve-${ARM}.log}"

arm_env "$ARM"
if [[ "$ARM" == flydsl ]]; then
	log "doctor --strict with: ${ARM_ENV[*]}"
	env "${ARM_ENV[@]}" vllm-flydsl-indexer doctor --strict ||
		die "the FlyDSL arm would not be active here (see the doctor report above)"
fi

stop_server_on_exit

start_server "$ARM" "$LOG_FILE"
wait_for_health || die "no healthy server; see ${LOG_FILE}"
check_plugin_lines "$ARM" "$LOG_FILE" "$TP" || die "the ${ARM} arm is not what was asked for; see ${LOG_FILE}"
log "READY: ${ARM} arm serving ${MODEL} at http://${HOST}:${PORT}/v1 (Ctrl-C stops it)"
wait "$SERVER_PID" || die "the server exited with status $?; see ${LOG_FILE}"
