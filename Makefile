# Shortcuts; each target is the same script the README and CI use.
.PHONY: demo test lint
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy
