"""`tandem generate`: stream a generation from a target service to the terminal."""
from __future__ import annotations

import argparse
import asyncio
import sys

from tandem.client import chat_request, generate, open_channel
from pathlib import Path

from tandem.tls import ClientTls, read_token
from tandem.v1 import generation_pb2, generation_pb2_grpc, structured_pb2


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem client")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream one generation")
    gen.add_argument("prompt", help="the prompt, or the user message with --chat")
    gen.add_argument("--target", default="127.0.0.1:50051", help="host:port of the target service")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--system", default="", help="a system message (with --chat)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", default=[], help="a stop string; repeatable")
    gen.add_argument("--no-speculate", action="store_true", help="turn speculation off for this request")
    gen.add_argument("--num-speculative-tokens", type=int, default=None)
    structured = gen.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE", help="the output follows this JSON schema (a file)")
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--regex", help="the output matches this regular expression")
    structured.add_argument("--grammar", metavar="FILE", help="the output follows this Lark or GBNF grammar (a file)")
    structured.add_argument("--choice", action="append", help="the output is one of these strings; repeatable")
    gen.add_argument("--disable-any-whitespace", action="store_true",
                     help="with --json-schema or --json-object: compact JSON, which speculation drafts faster")
    gen.add_argument("--tls", action="store_true", help="TLS with the system's roots (implied by the files below)")
    gen.add_argument("--ca-cert", default="", help="PEM CA bundle that verifies the target's certificate")
    gen.add_argument("--client-cert", default="", help="PEM certificate for a target that requires mTLS")
    gen.add_argument("--client-key", default="", help="PEM private key of --client-cert")
    gen.add_argument("--token", default="", help="bearer token of a target started with --auth-token")
    gen.add_argument("--token-file", default="", help="file holding the bearer token (not visible in ps)")
    return parser


def _request(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                    max_tokens=args.max_tokens, stop=args.stop, speculate=not args.no_speculate)
    if args.seed is not None:
        sampling["seed"] = args.seed
    if args.num_speculative_tokens is not None:
        sampling["num_speculative_tokens"] = args.num_speculative_tokens
    constraint = _structured_outputs(args)
    if constraint is not None:
        sampling["structured_outputs"] = constraint
    if args.chat:
        return chat_request(args.prompt, system=args.system, **sampling)
    return generation_pb2.GenerateRequest(prompt=args.prompt,
                                          sampling_params=generation_pb2.SamplingParams(**sampling))


def _structured_outputs(args: argparse.Namespace) -> structured_pb2.StructuredOutputs | None:
    """The constraint the flags ask for; files are read here, and the server checks what they hold."""
    compact = args.disable_any_whitespace
    if args.json_schema:
        return structured_pb2.StructuredOutputs(json=Path(args.json_schema).read_text(), disable_any_whitespace=compact)
    if args.json_object:
        return structured_pb2.StructuredOutputs(json_object=True, disable_any_whitespace=compact)
    if compact:
        raise ValueError("--disable-any-whitespace applies to --json-schema and --json-object")
    if args.regex is not None:
        return structured_pb2.StructuredOutputs(regex=args.regex)
    if args.grammar:
        return structured_pb2.StructuredOutputs(grammar=Path(args.grammar).read_text())
    if args.choice:
        return structured_pb2.StructuredOutputs(choice=structured_pb2.Choices(choices=args.choice))
    return None


async def run_generate(args: argparse.Namespace) -> int:
    import grpc

    try:
        tls = ClientTls.from_flags(args.ca_cert, args.client_cert, args.client_key, enabled=args.tls)
        token = read_token(args.token, args.token_file)
        request = _request(args)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    async with open_channel(args.target, tls, token) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            result = await generate(stub, request, on_text=lambda t: print(t, end="", flush=True))
        except grpc.aio.AioRpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print()  # stdout holds only the generated text, so that `tandem generate ... > out.txt` keeps the answer
    print(result.summary(), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sys.exit(asyncio.run(run_generate(args)))


if __name__ == "__main__":
    main()
