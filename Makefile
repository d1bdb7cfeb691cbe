# Shortcuts; each target is the same script the README and CI use.
.PHONY: demo test lint bench
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
bench:
	bash scripts/services.sh && bash scripts/bootstrap.sh
	.venv/bin/python -m pip install -q -e '.[dev,bench]'
	.venv/bin/python bench/compare.py
lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy
