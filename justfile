# kvscope's everyday commands. `just --list` shows them.

venv := ".venv/bin/"

# Install kvscope and its test tools into .venv
install:
    python3 -m venv .venv
    {{venv}}pip install torch==2.13.0 -e '.[dev,ray]'

# Serve the bundled model on 127.0.0.1:8000
serve *ARGS:
    {{venv}}kvscope serve {{ARGS}}

# Run the test suite (what .ci/run runs)
test *ARGS:
    {{venv}}python -m pytest -q {{ARGS}}

# Run a benchmark: just bench cancel | just bench throughput
bench *ARGS:
    {{venv}}kvscope bench {{ARGS}}

# Lint and type-check
lint:
    {{venv}}ruff check kvscope tests
    {{venv}}ruff format --check kvscope tests
    {{venv}}mypy kvscope
