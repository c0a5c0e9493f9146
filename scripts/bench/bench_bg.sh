#!/usr/bin/env bash
# A benchmark that outlives one device command: started in its own process session, collected later.
#
#   bash scripts/bench/bench_bg.sh start 'NGPU=2 bash scripts/bench/bench_multigpu.sh exact scale'
#   bash scripts/bench/bench_bg.sh wait 560        # in this and later commands, while the machine stays warm
#
# Why: one device command may run 10 minutes, a warm machine keeps its processes between commands, and a
# benchmark session (several launches, each a few minutes) is longer than one command. `start` runs the
# command with OUT=$BG (default /tmp/bg), which is not emptied between commands. `wait` waits up to N s
# (default 560) for it to finish, then packs $BG (Chrome traces left out: they are large and the op tables
# beside them say the same) into $OUT/0_bg.tgz, with the log's end in $OUT/0_bg_log.txt, so that a run
# cut off later still returns what it finished. The packed results are few files, as the device returns
# at most 8.
set -u
cd "$(dirname "$0")/../.."
BG=${BG:-/tmp/bg}
case ${1:-} in
  start)
    [ -e "$BG/log.txt" ] && [ ! -e "$BG/done" ] && { echo "a background run is already going in $BG"; exit 1; }
    rm -rf "$BG" && mkdir -p "$BG"
    OUT=$BG setsid nohup bash -c "$2; echo \"exit \$?\" > $BG/done" > "$BG/log.txt" 2>&1 < /dev/null &
    echo "started in the background: $BG" ;;
  wait)
    for _ in $(seq "${2:-560}"); do [ -e "$BG/done" ] && break; sleep 1; done
    mkdir -p "${OUT:?OUT must be set}"
    tar -czf "$OUT/0_bg.tgz" -C "$BG" --exclude='profile_step*_rank*.json' --exclude='*.pt' .
    tail -c 20000 "$BG/log.txt" > "$OUT/0_bg_log.txt"
    grep -h "^RESULT \|^CHECK \|^=== \|PASS\|FAIL" "$BG/log.txt" | cut -c1-400 | tail -60
    if [ -e "$BG/done" ]; then echo "background run finished: $(cat "$BG/done")"; else echo "still running"; fi ;;
  *) echo "usage: bench_bg.sh start CMD | wait [SECONDS]"; exit 2 ;;
esac
