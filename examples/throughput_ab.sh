#!/usr/bin/env bash
# Throughput A/B: stock Gluon kernel versus FlyDSL kernel, same server settings.
#
# For each arm (stock, then flydsl) it starts `vllm serve` with the arm's switch,
# waits for /health, checks the plugin's per-process log line, runs
# `vllm bench serve` on the random data set (fixed input/output lengths, fixed seed,
# --ignore-eos) at each concurrency, and stops the server. Then bench_table.py
# compares output tokens/s and mean/median TPOT.
#
# With TUNE=1 it first tunes on this node, then A/Bs with the table:
#   1. `vllm-flydsl-indexer tune --out "$TUNED_CSV"` times Gluon against FlyDSL for
#      the indexer shapes on this GPU and merges one row per shape (the winner and
#      both times) into the aiter-format table;
#   2. `vllm-flydsl-indexer doctor --json` must report that table in use for this
#      GPU (a table of another arch, or a malformed one, would be ignored);
#   3. both arms' servers get VLLM_FLYDSL_INDEXER_TUNED_CSV="$TUNED_CSV" (only the
#      flydsl arm reads it): per batch size the table sends each shape to FlyDSL
#      or keeps stock, and no process may log that it ignored the table.
# TUNED_CSV=FILE without TUNE=1 A/Bs with a table tuned earlier (steps 2 and 3).
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
#   TUNE [0]  1 = tune on this node first (above)
#   TUNED_CSV ["", with TUNE=1: $OUT_DIR/paged_mqa_logits_tuned.csv]  the table
#   TUNE_ARGS [""]  extra `tune --out` flags, split on spaces (e.g. "--batch 1,64")
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
: "${TUNE:=0}"
: "${TUNE_ARGS:=}"

if (($# > 0)); then
	print_usage "${BASH_SOURCE[0]}"
	[[ "$1" == -h || "$1" == --help ]] && exit 0
	exit 2
fi

read -r -a arms <<<"$ARMS"
read -r -a concurrencies <<<"$CONCURRENCIES"
for arm in "${arms[@]}"; do check_arm "$arm"; done
check_vllm_plugins
[[ "$TUNE" == 0 || "$TUNE" == 1 ]] || die "TUNE='${TUNE}' is not 0 or 1"
if [[ "$TUNE" == 1 && -z "$TUNED_CSV" ]]; then TUNED_CSV="${OUT_DIR}/paged_mqa_logits_tuned.csv"; fi

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

# tune_table: time Gluon against FlyDSL on this node, merging the winners into TUNED_CSV.
tune_table() {
	local extra=()
	read -r -a extra <<<"$TUNE_ARGS"
	TUNE_ARGV=(tune --out "$TUNED_CSV" "${extra[@]}")
	log "tuning on this node: VLLM_ROCM_USE_AITER=1 vllm-flydsl-indexer ${TUNE_ARGV[*]}"
	VLLM_ROCM_USE_AITER=1 vllm-flydsl-indexer "${TUNE_ARGV[@]}" 2>&1 | tee "${OUT_DIR}/tune.log"
}

# check_table_in_use: the plugin, as the flydsl arm's server will run it, reads TUNED_CSV here.
check_table_in_use() {
	arm_env flydsl
	local verdict
	verdict=$(env "${ARM_ENV[@]}" vllm-flydsl-indexer doctor --json | "$PYTHON" -c '
import json, sys
table = json.load(sys.stdin)["tuned_table"]
print("%s rows for %s: %s" % (table.get("rows", 0), table.get("gfx", "-"), table["note"]))
sys.exit(0 if table["note"] == "in use" else 1)
') || die "the plugin would not use the tuned table ${TUNED_CSV}: ${verdict:-no doctor report}"
	log "tuned table ${TUNED_CSV}: ${verdict}"
}

mkdir -p "$OUT_DIR"
if [[ "$TUNE" == 1 ]]; then tune_table || die "tune --out failed; see ${OUT_DIR}/tune.log"; fi
if [[ -n "$TUNED_CSV" ]]; then check_table_in_use; fi
for arm in "${arms[@]}"; do
	server_log="${OUT_DIR}/${arm}/server.log"
	start_server "$arm" "$server_log"
	wait_for_health || die "no healthy ${arm} server; see ${server_log}"
	check_plugin_lines "$arm" "$server_log" "$TP" || die "the ${arm} arm is not what was asked for"
	if [[ "$arm" == flydsl && -n "$TUNED_CSV" ]]; then
		check_table_lines "$server_log" || die "the flydsl arm is not using the tuned table"
	fi
	for conc in "${concurrencies[@]}"; do
		bench_argv "$arm" "$conc"
		log "${arm}: vllm ${BENCH_ARGV[*]}"
		vllm "${BENCH_ARGV[@]}" 2>&1 | tee "${OUT_DIR}/${arm}/bench-c${conc}.log"
	done
	check_plugin_lines "$arm" "$server_log" "$TP" || die "the ${arm} arm changed during the run"
	if [[ "$arm" == flydsl && -n "$TUNED_CSV" ]]; then
		check_table_lines "$server_log" || die "the flydsl arm stopped using the tuned table"
	fi
	if [[ "$arm" == flydsl ]]; then report_stock_calls "$server_log"; fi
	stop_server
done

if [[ " ${arms[*]} " == *" stock "* && " ${arms[*]} " == *" flydsl "* ]]; then
	"$PYTHON" "$HERE/bench_table.py" "${OUT_DIR}/stock" "${OUT_DIR}/flydsl" | tee "${OUT_DIR}/bench_table.md"
fi
log "results in ${OUT_DIR}"
