# Compact timeline of a `kv_transfer.py --trace` run: its first LINES (default 30)
# events other than in-place payload posts and completions, then first/last time of
# each payload post/done kind (ms from the run's start).
# usage: bash kv_transfer_timeline.sh OUT_DIR MODE [LINES]
python3 "$(dirname "$0")/kv_transfer_trace.py" "$1" "$2" 0:100000 | grep "^ *[0-9]" > /tmp/tl.$$
grep -v "direct_post\|direct_done" /tmp/tl.$$ | head -"${3:-30}"
for e in send_direct_post recv_direct_post recv_direct_done send_direct_done \
         send_payload_post recv_payload_post recv_payload_done send_payload_done; do
  grep " $e " /tmp/tl.$$ | awk -v e=$e 'NR==1{f=$1} {l=$1; n++} END{if (n) printf "%-18s n=%3d first %8.3f last %8.3f\n", e, n, f, l}'
done
rm -f /tmp/tl.$$
