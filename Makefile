# One CPU virtual environment per SGLang release: .venv for the default
# release, .venv-<release> for the others. Every target builds what it needs.
SGLANG ?= 0.5.11
DEFAULT_SGLANG := 0.5.11
# Releases with live bugs, then one pass-through release.
MATRIX ?= 0.5.10.post1 0.5.11 0.5.12.post1 0.5.23

ifeq ($(SGLANG),$(DEFAULT_SGLANG))
VENV := .venv
else
VENV := .venv-$(SGLANG)
endif
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test test-all demo bench doctor clean

$(VENV)/.sglang-release: scripts/setup_venv.sh requirements/*.txt pyproject.toml
	scripts/setup_venv.sh $(SGLANG) $(VENV)

setup: $(VENV)/.sglang-release

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# The CI matrix: every release with a live bug plus the pass-through smoke.
test-all:
	@set -e; for r in $(MATRIX); do \
	  echo "=== SGLang $$r ==="; \
	  $(MAKE) --no-print-directory test SGLANG=$$r; \
	done

demo: setup
	$(VENV)/bin/sglang-disagg-ext doctor
	$(VENV)/bin/sglang-disagg-ext selftest

doctor: setup
	$(VENV)/bin/sglang-disagg-ext doctor

bench: setup
	$(PY) -m bench.run

clean:
	rm -rf .venv .venv-*
