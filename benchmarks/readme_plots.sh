#!/bin/sh
# Regenerate the README's pictures of the TCPStore and launcher benchmarks, and the CSV
# files they are drawn from, with the settings the README describes:
#
#     sh benchmarks/readme_plots.sh      # a few minutes; run it on a quiet machine
#
# writes benchmarks/results/store.{csv,png} and benchmarks/results/launcher.{csv,png}
# (each table is printed as the run ends). Redraw a picture from its CSV file alone with
# python benchmarks/plots.py store benchmarks/results/store.csv --png store.png (or
# launcher). Needs the peers' torch (CPU build is enough:
# pip install torch --index-url https://download.pytorch.org/whl/cpu) and matplotlib
# (pip install -e ".[bench]"). PYTHON names the interpreter (default: python).
set -eu
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
out=benchmarks/results
if ! "$python" -c "import matplotlib, torch.distributed" 2>/dev/null; then
    echo "$0: needs matplotlib and torch in $python:" \
         'pip install -e ".[bench]" and' \
         "pip install torch --index-url https://download.pytorch.org/whl/cpu" >&2
    exit 2
fi
mkdir -p "$out"
"$python" benchmarks/store.py --csv "$out/store.csv" --png "$out/store.png"
"$python" benchmarks/launcher.py --nproc 4 --repeat 5 \
    --csv "$out/launcher.csv" --png "$out/launcher.png"
