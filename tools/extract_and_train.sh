# Stages 02b, 03 and 04 of a demo script, which defines `extract`, `vocab` and `train` (each
# its stage's command; extra flags are appended) and sets STREAM and SPOOL_GB:
#   STREAM=0: 02b, 03, 04 one after the other;
#   STREAM=1: 03 first, then 02b and 04 at the same time, the train split's hidden states
#             streamed through a spool of at most SPOOL_GB (eagle3/extract/stream.py); 02b's
#             summary and the run summary show the spool's peak. When either fails the other
#             is stopped (it would wait for it).
if [ "${STREAM:-0}" = 1 ]; then
    vocab
    extract --stream --spool-gb "$SPOOL_GB" &
    producer=$!
    train --stream &
    trainer=$!
    # On the way out (one failed, or a signal): each side's shell is frozen first, so that it
    # can neither start its stage late nor run on once the stage ends; then the stage (its
    # child) gets SIGTERM, which it handles (finishes or abandons the record in flight), and
    # the frozen shell SIGKILL, which it cannot outlive.
    trap 'for p in "$producer" "$trainer"; do
              kill -STOP "$p" 2>/dev/null || continue
              pkill -TERM -P "$p" 2>/dev/null || true
              kill -KILL "$p" 2>/dev/null || true
          done' EXIT
    set +e
    wait -n -p first "$producer" "$trainer"  # the first to end (bash >= 5.1)
    rc=$?
    set -e
    [ "$rc" -eq 0 ] || exit "$rc"
    if [ "$first" = "$producer" ]; then wait "$trainer"; else wait "$producer"; fi
    trap - EXIT
else
    extract
    vocab
    train
fi
