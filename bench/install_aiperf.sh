#!/usr/bin/env bash
# aiperf (NVIDIA's load generator for OpenAI-compatible servers) in a venv of its own: it brings
# pandas, plotly, dash and more (about 1.2 GB), none of which Tandem needs, and no torch.
# Usage: bench/install_aiperf.sh [DIR]   (default DIR: /tmp/aiperf-venv); then
#        python -m bench.front_doors --aiperf DIR/bin/aiperf
set -euo pipefail
dir=${1:-/tmp/aiperf-venv}
[ -x "$dir/bin/python" ] || python3 -m venv "$dir"
"$dir/bin/pip" install -q "aiperf==0.13.0"
"$dir/bin/aiperf" --version
