"""Test-session setup: one persistent compilation cache for the whole run.

Many tests build an ``LLM`` over the same tiny checkpoints and bucket shapes; with
the cache in a directory of this session, an executable compiled by one test is
loaded by the next instead of compiled again (the user's own cache is not touched).
"""

import os
import tempfile

# torch's OpenMP threads spin-wait by default, which starves XLA:CPU's threads in the same process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("SPECJAX_COMPILATION_CACHE", os.path.join(tempfile.gettempdir(), "specjax-test-xla-cache"))
