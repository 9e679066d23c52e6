#!/usr/bin/env bash
# Throughput A/B: stock Gluon kernel versus FlyDSL kernel, same server settings.
#
# For each arm (stock, then flydsl) it starts `vllm serve` with the arm's switch,
# waits for /health, checks the plugin's per-process log line, runs
# `vllm bench serve` on the random data set (fixed input/output lengths, fixed seed,
# --ignore-eos) at each concurrency, and stops the server. Then bench_table.py
# compares output tokens/s and mean/median TPOT.
#
# Usage:
#   examples/throughput_ab.sh
#
# Environment (defaults in brackets):
#   MODEL [deepseek-ai/DeepSeek-V3.2-Exp]  TOKENIZER [$MODEL]  HOST [127.0.0.1]  PORT [8000]
#   TP [8]  SEED [0] (server)  EXTRA_SERVE_ARGS [""]  HEALTH_TIMEOUT [3600]
#   ARMS ["stock flydsl"]  the order the arms run in; run again reversed to check drift
#   CONCURRENCIES ["1 64"]  INPUT_LEN [8192]  OUTPUT_LEN [1024]
#   PROMPTS_PER_CONCURRENCY [8]  requests per run = concurrency * this
#   BENCH_SEED [0]  OUT_DIR [./flydsl-throughput-<timestamp>]  PYTHON [python3]
#
# The input length is well above DeepSeek-V3.2's 2048-token indexer top-k, so the
# decode steps measured are ones where the indexer's logits matter.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=_common.sh
source "$HERE/_common.sh"

: "${ARMS:=stock flydsl}"
: "${CONCURRENCIES:=1 64}"
: "${INPUT_LEN:=8192}"
: "${OUTPUT_LEN:=1024}"
: "${PROMPTS_PER_CONCURRENCY:=8}"
: "${BENCH_SEED:=0}"
: "${OUT_DIR:=flydsl-throughput-$(date +%Y%m%d-%H%M%S)}"

if (($# > 0)); then
	print_usage "${BASH_SOURCE[0]}"
	[[ "$1" == -h || "$1" == --help ]] && exit 0
	exit 2
fi

read -r -a arms <<<"$ARMS"
read -r -a concurrencies <<<"$CONCURRENCIES"
for arm in "${arms[@]}"; do check_arm "$arm"; done
check_vllm_plugins

stop_server_on_exit

# bench_argv ARM CONCURRENCY: set BENCH_ARGV to the `vllm` arguments of one benchmark run.
bench_argv() {
	local arm=$1 conc=$2
	BENCH_ARGV=(
		bench serve
		--backend openai
		--base-url "http://${HOST}:${PORT}"
		--endpoint /v1/completions
		--model "$MODEL"
		--tokenizer "$TOKENIZER"
		--dataset-name random
		--random-input-len "$INPUT_LEN"
		--random-output-len "$OUTPUT_LEN"
		--random-range-ratio 0
		--ignore-eos
		--temperature 0
		--num-prompts "$((conc * PROMPTS_PER_CONCURRENCY))"
		--max-concurrency "$conc"
		--num-warmups "$conc"
		--seed "$BENCH_SEED"
		--label "$arm"
		--metadata "arm=${arm}" "random_input_len=${INPUT_LEN}" "random_output_len=${OUTPUT_LEN}"
		--save-result
		--result-dir "${OUT_DIR}/${arm}"
		--result-filename "c${conc}.json"
	)
}

mkdir -p "$OUT_DIR"
for arm in "${arms[@]}"; do
	server_log="${OUT_DIR}/${arm}/server.log"
	start_server "$arm" "$server_log"
	wait_for_health || die "no healthy ${arm} server; see ${server_log}"
	check_plugin_lines "$arm" "$server_log" "$TP" || die "the ${arm} arm is not what was asked for"
	for conc in "${concurrencies[@]}"; do
		bench_argv "$arm" "$conc"
		log "${arm}: vllm ${BENCH_ARGV[*]}"
		vllm "${BENCH_ARGV[@]}" 2>&1 | tee "${OUT_DIR}/${arm}/bench-c${conc}.log"
	done
	check_plugin_lines "$arm" "$server_log" "$TP" || die "the ${arm} arm changed during the run"
	if [[ "$arm" == flydsl ]]; then report_stock_calls "$server_log"; fi
	stop_server
done

if [[ " ${arms[*]} " == *" stock "* && " ${arms[*]} " == *" flydsl "* ]]; then
	"$PYTHON" "$HERE/bench_table.py" "${OUT_DIR}/stock" "${OUT_DIR}/flydsl" | tee "${OUT_DIR}/bench_table.md"
fi
log "results in ${OUT_DIR}"
