# Thin wrappers around scripts/ (the README's two commands are ./scripts/demo and ./scripts/test).
.PHONY: setup demo test bench

setup:
	scripts/setup

demo:
	scripts/demo $(ARGS)

test:
	scripts/test $(ARGS)

bench: setup
	@set -e; found=0; for f in bench/*.py; do \
		[ -e "$$f" ] || continue; found=1; \
		echo "== $$f"; .venv/bin/python "$$f"; \
	done; \
	[ $$found = 1 ] || echo "no benchmarks under bench/"
