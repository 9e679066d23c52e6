# shellcheck shell=bash
# Helpers shared by serve_tp8.sh, accuracy_ab.sh and throughput_ab.sh.
# Source it (the scripts do); running it does nothing.
#
# Every variable below has a default and can be overridden from the environment.
# Both arms of an A/B get the same server command line; the plugin switch is the
# only difference between them (see arm_env).

: "${MODEL:=deepseek-ai/DeepSeek-V3.2-Exp}"
: "${TOKENIZER:=$MODEL}"
: "${HOST:=127.0.0.1}"
: "${PORT:=8000}"
: "${TP:=8}"
: "${SEED:=0}"
# Extra `vllm serve` flags for both arms, split on spaces (e.g. "--max-model-len 131072").
# No compilation flag is needed for FlyDSL: on a GPU vLLM runs eager warm-up steps
# before it captures CUDA graphs, and those compile FlyDSL's kernels first.
: "${EXTRA_SERVE_ARGS:=}"
# An aiter-format tuned table (`vllm-flydsl-indexer tune --out FILE`), passed to both
# arms' servers as VLLM_FLYDSL_INDEXER_TUNED_CSV; only the flydsl arm reads it.
: "${TUNED_CSV:=}"
: "${HEALTH_TIMEOUT:=3600}" # seconds; loading and compiling a 671B model takes a while
: "${HEALTH_POLL:=5}"       # seconds between /health probes (fractions work)
: "${STOP_TIMEOUT:=120}"    # seconds to wait after SIGTERM before SIGKILL
: "${PYTHON:=python3}"

FLYDSL_SWITCH=VLLM_ROCM_USE_AITER_FLYDSL_PAGED_MQA_LOGITS
PLUGIN_NAME=flydsl_indexer
# The one line each vLLM process logs (API server, EngineCore, every worker).
ACTIVE_LINE="vllm-flydsl-indexer: FlyDSL paged MQA logits ACTIVE"
STOCK_LINE="vllm-flydsl-indexer: stock paged MQA logits (FlyDSL inactive:"
# In the ERROR a process logs when a shape's self-test or FlyDSL launch failed: that shape uses
# the stock path in that process until vLLM restarts.
SHAPE_STOCK_LINE="This call and every later call of this shape use the stock path until vLLM restarts"
# No run-time line says that a model's indexer never calls the patched function (DeepSeek-V4 on
# the MXFP4 indexer: both arms would run stock): ask `vllm-flydsl-indexer doctor --model DIR`
# (a model directory or model type) before an A/B.
# Logged once per distinct reason when an eligible-looking call kept the stock path.
STOCK_CALL_LINE="vllm-flydsl-indexer: stock path for this call:"
# Logged (WARNING) when a tuned table cannot be used: the process routes without it.
TABLE_IGNORED_LINE="vllm-flydsl-indexer: tuned table ignored:"
TUNED_CSV_VAR=VLLM_FLYDSL_INDEXER_TUNED_CSV

SERVER_PID=""

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}

# check_arm ARM: accept only the two arm names.
check_arm() {
	case "$1" in
	stock | flydsl) ;;
	*) die "unknown arm '$1' (use stock or flydsl)" ;;
	esac
}

# check_vllm_plugins: if VLLM_PLUGINS is set, it must name this plugin.
check_vllm_plugins() {
	if [[ -v VLLM_PLUGINS ]] && [[ ",${VLLM_PLUGINS}," != *",${PLUGIN_NAME},"* ]]; then
		die "VLLM_PLUGINS='${VLLM_PLUGINS}' does not include ${PLUGIN_NAME}; add it or unset VLLM_PLUGINS"
	fi
}

# arm_env ARM: set ARM_ENV to the environment that selects the arm.
arm_env() {
	check_arm "$1"
	local switch=0
	[[ "$1" == flydsl ]] && switch=1
	ARM_ENV=(VLLM_ROCM_USE_AITER=1 "${FLYDSL_SWITCH}=${switch}")
	if [[ -n "$TUNED_CSV" ]]; then ARM_ENV+=("${TUNED_CSV_VAR}=${TUNED_CSV}"); fi
}

# serve_argv: set SERVE_ARGV to the `vllm` arguments (identical for both arms).
serve_argv() {
	local extra=()
	read -r -a extra <<<"$EXTRA_SERVE_ARGS"
	SERVE_ARGV=(
		serve "$MODEL"
		--host "$HOST"
		--port "$PORT"
		--tensor-parallel-size "$TP"
		--seed "$SEED"
		"${extra[@]}"
	)
}

# start_server ARM LOGFILE: start `vllm serve` for ARM in its own session, output to LOGFILE.
start_server() {
	local arm=$1 logfile=$2
	arm_env "$arm"
	serve_argv
	mkdir -p "$(dirname "$logfile")"
	log "starting the ${arm} server: ${ARM_ENV[*]} vllm ${SERVE_ARGV[*]}"
	log "server log: ${logfile}"
	# setsid: the server and all its workers share one process group, which stop_server ends.
	setsid env "${ARM_ENV[@]}" vllm "${SERVE_ARGV[@]}" >"$logfile" 2>&1 </dev/null &
	SERVER_PID=$!
}

# wait_for_health: poll /health until it answers 200, the server exits, or HEALTH_TIMEOUT passes.
wait_for_health() {
	local url="http://${HOST}:${PORT}/health"
	local deadline=$((SECONDS + HEALTH_TIMEOUT))
	log "waiting up to ${HEALTH_TIMEOUT}s for ${url}"
	while ((SECONDS < deadline)); do
		if ! kill -0 "$SERVER_PID" 2>/dev/null; then
			log "the server exited before it became healthy"
			return 1
		fi
		if curl -fs -o /dev/null --max-time 5 "$url"; then
			log "server is healthy"
			return 0
		fi
		sleep "$HEALTH_POLL"
	done
	log "the server did not become healthy within ${HEALTH_TIMEOUT}s"
	return 1
}

# stop_server: SIGTERM the server's process group, SIGKILL it after STOP_TIMEOUT seconds.
stop_server() {
	local pid=$SERVER_PID
	[[ -n "$pid" ]] || return 0
	SERVER_PID=""
	if kill -0 -- "-$pid" 2>/dev/null; then
		log "stopping the server (process group ${pid})"
		kill -TERM -- "-$pid" 2>/dev/null || true
		local deadline=$((SECONDS + STOP_TIMEOUT))
		while kill -0 -- "-$pid" 2>/dev/null && ((SECONDS < deadline)); do
			sleep 0.5
		done
		if kill -0 -- "-$pid" 2>/dev/null; then
			log "still running after ${STOP_TIMEOUT}s; sending SIGKILL"
			kill -KILL -- "-$pid" 2>/dev/null || true
		fi
	fi
	wait "$pid" 2>/dev/null || true
}

# count_lines PATTERN FILE: how many lines of FILE contain PATTERN (fixed string).
count_lines() {
	grep -cF -- "$1" "$2" || true
}

# check_plugin_lines ARM LOGFILE MIN_ACTIVE: the plugin's per-process lines match the arm.
# flydsl: at least MIN_ACTIVE processes (the TP workers) say ACTIVE, and no shape failed its
# self-test or a launch (SHAPE_STOCK_LINE: that shape runs stock in that process).
# stock: the plugin loaded (at least one line) and no process says ACTIVE.
check_plugin_lines() {
	local arm=$1 logfile=$2 min_active=$3
	local active stock failed
	active=$(count_lines "$ACTIVE_LINE" "$logfile")
	stock=$(count_lines "$STOCK_LINE" "$logfile")
	failed=$(count_lines "$SHAPE_STOCK_LINE" "$logfile")
	log "plugin lines in ${logfile}: ${active} ACTIVE, ${stock} stock, ${failed} shape(s) failed to stock"
	grep -F -e "$ACTIVE_LINE" -e "$STOCK_LINE" -e "$SHAPE_STOCK_LINE" -- "$logfile" >&2 || true
	if ((active + stock == 0)); then
		log "no vllm-flydsl-indexer line: is the plugin pip-installed in this environment?"
		return 1
	fi
	if [[ "$arm" == flydsl ]]; then
		if ((active < min_active)); then
			log "expected at least ${min_active} ACTIVE processes, found ${active}"
			return 1
		fi
		if ((failed > 0)); then
			log "${failed} shape(s) failed FlyDSL's self-test or launch; they run the stock path until restart"
			return 1
		fi
	elif ((active > 0)); then
		log "the stock arm has ${active} ACTIVE process(es)"
		return 1
	fi
	return 0
}

# report_stock_calls LOGFILE: list why eligible-looking calls kept the stock path (informational).
report_stock_calls() {
	local n
	n=$(count_lines "$STOCK_CALL_LINE" "$1")
	((n == 0)) && return 0
	log "${n} distinct reason(s) for stock-path calls (e.g. a strided KV cache layout, or a tuned table's pick):"
	grep -F -- "$STOCK_CALL_LINE" "$1" >&2 || true
}

# check_table_lines LOGFILE: no process logged that it ignored the tuned table (TUNED_CSV).
check_table_lines() {
	local n
	n=$(count_lines "$TABLE_IGNORED_LINE" "$1")
	((n == 0)) && return 0
	grep -F -- "$TABLE_IGNORED_LINE" "$1" >&2 || true
	log "${n} line(s) say the tuned table ${TUNED_CSV} was ignored: those processes route without it"
	return 1
}

# print_usage SCRIPT: print SCRIPT's header comment (line 2 up to `set -euo`).
print_usage() {
	sed -n '2,/^set -euo/p' "$1" | sed '$d; s/^# \{0,1\}//'
}

# stop_server_on_exit: stop the server however the script ends, keeping its exit code.
_stop_server_and_exit() {
	local rc=$?
	stop_server
	exit "$rc"
}

stop_server_on_exit() {
	trap _stop_server_and_exit EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
}
