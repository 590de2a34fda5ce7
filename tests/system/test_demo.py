"""`make demo` as a new user runs it: both services start, a chat streams with drafts accepted, both stop."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from draft_service.config import DraftConfig

# With another test's services busy beside it on 2 cores, its drafter can fall so far behind that
# no draft is accepted: `make test` runs it alone, as a user runs `make demo`.
pytestmark = pytest.mark.alone


def test_the_demo_streams_a_chat_with_the_default_drafter_and_stops_cleanly():
    done = subprocess.run([sys.executable, "-m", "tandem.demo"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # The draft service's default drafter; a lookup drafter loads only the target's tokenizer.
    assert f"starting the draft service ({DraftConfig().drafter}: smollm2-135m)" in done.stdout
    # The statistics line goes to stderr, the streamed text to stdout (as `tandem generate` does).
    summary = re.search(r"(\d+) tokens · .* acceptance (\d+)% · mean acceptance length ([\d.]+) · finish (\w+)",
                        done.stderr)
    assert summary, done.stderr
    assert summary.group(4) == "stop", "the demo's answer was cut off by its token budget"
    assert int(summary.group(2)) > 0 and float(summary.group(3)) > 1, "no draft was accepted"
    assert re.search(r"\$ curl http://127\.0\.0\.1:\d+/v1/chat/completions", done.stdout)
    assert re.search(r"\(\d+ tokens, finish (stop|length)\)", done.stdout), done.stdout
    assert re.search(r'get_weather\(\{"city": ?"[^"]+"\}\)  \(finish tool_calls\)', done.stdout), done.stdout
    assert "stopped both services (exit codes 0, 0)" in done.stdout
