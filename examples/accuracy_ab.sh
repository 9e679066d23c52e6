#!/usr/bin/env bash
# Accuracy A/B: stock Gluon kernel versus FlyDSL kernel, same server settings and seeds.
#
# For each arm (stock, then flydsl) it starts `vllm serve` with the arm's switch,
# waits for /health, checks the plugin's per-process log line, runs lm-eval against
# the server's /v1/completions for each task, checks the log lines again (a shape whose
# self-test or launch fails turns stock mid-run), and stops the server. Then
# ab_table.py prints stock, flydsl, difference and its standard error per metric.
#
# Usage:
#   examples/accuracy_ab.sh
#
# Environment (defaults in brackets):
#   MODEL [deepseek-ai/DeepSeek-V3.2-Exp]  TOKENIZER [$MODEL]  HOST [127.0.0.1]  PORT [8000]
#   TP [8]  SEED [0] (server)  EXTRA_SERVE_ARGS [""]  HEALTH_TIMEOUT [3600]
#   ARMS ["stock flydsl"]  TASKS ["gsm8k niah"] (add gpqa: a gated data set, needs HF login)
#   NUM_CONCURRENT [32]  EVAL_SEED [1234]  NIAH_LENGTHS [32768,65536]  GPQA_MAX_GEN_TOKS [4096]
#   OUT_DIR [./flydsl-accuracy-<timestamp>]  PYTHON [python3]
#
# Needs: pip install "lm-eval[api,ruler]==0.4.13" (ruler: the niah task's extras).
# The lm_eval arguments come from lm_eval_args.py; print them with
#   python examples/lm_eval_args.py --task gsm8k --model M --base-url U --output-path D
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$HERE/_common.sh"

: "${ARMS:=stock flydsl}"
: "${TASKS:=gsm8k niah}"
: "${NUM_CONCURRENT:=32}"
: "${EVAL_SEED:=1234}"
: "${NIAH_LENGTHS:=32768,65536}"
: "${GPQA_MAX_GEN_TOKS:=4096}"
: "${OUT_DIR:=flydsl-accuracy-$(date +%Y%m%d-%H%M%S)}"

if (($# > 0)); then
	print_usage "${BASH_SOURCE[0]}"
	[[ "$1" == -h || "$1" == --help ]] && exit 0
	exit 2
fi

read -r -a arms <<<"$ARMS"
read -r -a tasks <<<"$TASKS"
for arm in "${arms[@]}"; do check_arm "$arm"; done
check_vllm_plugins

stop_server_on_exit

# lm_eval_argv ARM TASK: set LM_EVAL_ARGV from lm_eval_args.py (identical for both arms
# except the output path).
lm_eval_argv() {
	local arm=$1 task=$2 text
	text="$("$PYTHON" "$HERE/lm_eval_args.py" \
		--task "$task" \
		--model "$MODEL" \
		--tokenizer "$TOKENIZER" \
		--base-url "http://${HOST}:${PORT}/v1/completions" \
		--output-path "${OUT_DIR}/${arm}/${task}" \
		--seed "$EVAL_SEED" \
		--num-concurrent "$NUM_CONCURRENT" \
		--gpqa-max-gen-toks "$GPQA_MAX_GEN_TOKS" \
		--niah-lengths "$NIAH_LENGTHS")"
	mapfile -t LM_EVAL_ARGV <<<"$text"
}

# Build every argument vector before starting a server, so a bad setting fails fast.
for task in "${tasks[@]}"; do lm_eval_argv stock "$task"; done

mkdir -p "$OUT_DIR"
for arm in "${arms[@]}"; do
	server_log="${OUT_DIR}/${arm}/server.log"
	start_server "$arm" "$server_log"
	wait_for_health || die "no healthy ${arm} server; see ${server_log}"
	check_plugin_lines "$arm" "$server_log" "$TP" || die "the ${arm} arm is not what was asked for"
	for task in "${tasks[@]}"; do
		lm_eval_argv "$arm" "$task"
		log "${arm}: lm_eval ${LM_EVAL_ARGV[*]}"
		lm_eval "${LM_EVAL_ARGV[@]}" 2>&1 | tee "${OUT_DIR}/${arm}/${task}.log"
	done
	check_plugin_lines "$arm" "$server_log" "$TP" || die "the ${arm} arm changed during the run"
	if [[ "$arm" == flydsl ]]; then report_stock_calls "$server_log"; fi
	stop_server
done

if [[ " ${arms[*]} " == *" stock "* && " ${arms[*]} " == *" flydsl "* ]]; then
	"$PYTHON" "$HERE/ab_table.py" "${OUT_DIR}/stock" "${OUT_DIR}/flydsl" | tee "${OUT_DIR}/ab_table.md"
fi
log "results in ${OUT_DIR}"
