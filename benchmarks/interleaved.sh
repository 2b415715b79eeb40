#!/usr/bin/env bash
# Runs benchmarks on another commit and on this working tree, interleaved (other, this, other, this,
# ...), so that both meet the same machine: on shared 2-core boxes a run alone moves by 30% or more,
# and the machine of another day by more. Each run's output goes to OUT/<bench>.<other|this>.<round>.out.
#
#   bash benchmarks/interleaved.sh REV OUT ROUNDS BENCH [BENCH ...]
#   bash benchmarks/interleaved.sh BASE_REVISION WORK_DIR 3 bench_engine bench_compiled bench_reuse
#   bash benchmarks/interleaved.sh BASE_REVISION WORK_DIR 3 "bench_llamacpp --llama-cpp DIR --gguf F"
#
# A BENCH is a script's name under benchmarks/, with its arguments after it in the same word (quoted).
# REV is checked out in a temporary git worktree; each run imports the tree it is run from
# (PYTHONPATH), with the current venv's packages, one thread (OMP_NUM_THREADS=1), and each side keeps
# its own cache folder (XDG_CACHE_HOME=OUT/cache.<side>: the kernel choices and native builds, which
# the two trees would otherwise overwrite in one file and measure again at every load).
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,14p' "$0" >&2
    exit 2
fi
rev=$1 out=$2 rounds=$3
shift 3
here=$(git rev-parse --show-toplevel)
other=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$other" >/dev/null 2>&1 || rm -rf "$other"' EXIT
git -C "$here" worktree add --detach "$other" "$rev" >/dev/null
mkdir -p "$out"
out=$(cd "$out" && pwd) # (each run changes into its tree)
export OMP_NUM_THREADS=1
for spec in "$@"; do
    read -r -a argv <<<"$spec"
    bench=${argv[0]}
    for round in $(seq 1 "$rounds"); do
        for side in other this; do
            root=$other
            [ "$side" = this ] && root=$here
            echo "$(date +%T) $bench $side round $round" | tee -a "$out/progress.log"
            (cd "$root" && XDG_CACHE_HOME="$out/cache.$side" PYTHONPATH="$root" python "benchmarks/$bench.py" "${argv[@]:1}") >"$out/$bench.$side.$round.out" 2>&1 ||
                echo "  failed: see $out/$bench.$side.$round.out" | tee -a "$out/progress.log"
        done
    done
done
