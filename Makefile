# One CPU virtual environment per SGLang release: .venv for the default
# release, .venv-<release> for the others. Every target builds what it needs.
SGLANG ?= 0.5.11
DEFAULT_SGLANG := 0.5.11
# The CI matrix: every release with patches/ and one representative of every release family
# (releases with the same fix statuses and recorded probe values; scripts/ci_plan.py).
MATRIX ?= $(shell python3 scripts/ci_plan.py matrix)

ifeq ($(SGLANG),$(DEFAULT_SGLANG))
VENV := .venv
else
VENV := .venv-$(SGLANG)
endif
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Test processes (pytest-xdist). Most tests spend their time waiting on the worker
# processes and engines they start, so 4 keep a 2-core machine busy: the whole suite
# ran in 444 s with 4 instead of ~650 s in one (0.5.23). PYTEST_WORKERS=0: one process.
# worksteal: a worker that runs out takes queued tests from a busy one, so a leg does not end
# with one worker finishing a queue of slow scenario runs while the others sit idle.
PYTEST_WORKERS ?= 4
XDIST := -n $(PYTEST_WORKERS) --dist worksteal
# patches/<release>/: the fixes as unified diffs against each release's sources.
PATCH_RELEASES ?= $(sort $(notdir $(patsubst %/,%,$(dir $(wildcard patches/*/*.patch)))))
PATCHED := .patched-$(SGLANG)
PATCHED_TESTS := test/integration/test_mooncake_ext.py test/integration/test_nixl_ext.py \
	test/integration/test_retract_f5.py test/integration/test_mori_ext.py
# Fixes only one release's patches carry (patches/0.5.23: F6, F7, F8, F9, F10, F14, F15, F20): their tests run on its patched leg.
PATCHED_TESTS_0.5.23 := test/integration/test_mooncake_state_pairing.py test/integration/test_mooncake_threads.py \
	test/integration/test_mooncake_registration.py test/integration/test_metadata_gate.py \
	test/integration/test_mooncake_isolation.py test/integration/test_decode_pairing_check.py \
	test/integration/test_nixl_bootstrap_screen.py test/integration/test_prefill_lookup.py \
	test/integration/test_held_pages.py test/integration/test_nixl_transfer_deadline.py
PATCHED_TESTS += $(PATCHED_TESTS_$(SGLANG))

# Every release with a pin file in requirements/ (the policy table's releases), oldest first.
ALL_RELEASES := $(shell ls requirements/sglang-*.txt | sed 's|requirements/sglang-\(.*\)\.txt|\1|' | sort -V)

# Releases whose CI leg also runs the real-server stage (make e2e): 0.5.11 and the newest (the
# two the stage was built on). On 0.5.11 CI leaves out the decode-kill pair (85 s of
# the stage on 0.5.23) and the unanswering-prefill pair (F20, 55 s; the harness proves F20 on every
# leg); `make e2e SGLANG=0.5.11` runs both by hand. E2E_CI_ARGS_<release> is what a release's CI
# leg adds to the stage's pytest arguments.
E2E_RELEASES ?= 0.5.11 0.5.23
E2E_CI_ARGS_0.5.11 := --deselect "test/servers/test_pd_faults.py::test_decode_killed_and_restarted_mid_stream[mooncake]" \
	--deselect "test/servers/test_pd_faults.py::test_decode_killed_and_restarted_mid_stream[mooncake-ext]" \
	--deselect "test/servers/test_pd_faults.py::test_a_prefill_address_that_never_answers[mooncake]" \
	--deselect "test/servers/test_pd_faults.py::test_a_prefill_address_that_never_answers[mooncake-ext]"
# The mixed-release stage (make mixed): this release beside each release of MIXED_DECODES_<release>
# in its own venv. test/mixed: F19 (a prefill newer than its decode) through the harness, and with
# the first release of the list both upgrade orders through real servers (test/mixed/servers, one
# process); later releases of the list run the Mooncake pair only (F19's code is the same for NIXL).
# CI runs it on the newest release's leg and deletes the decode venvs after it.
MIXED_DECODES_0.5.23 := 0.5.11 0.5.22
# Releases whose CI leg runs stock SGLang on its patched sources (make test-patched; ~2.5 min a
# release). Every patched release's leg checks that its patches apply (make check-patches); the
# patched-stock tests of the older patched releases run by hand (make test-patched SGLANG=<r>).
PATCH_TEST_RELEASES ?= 0.5.23

.PHONY: setup test test-all mixed demo bench soak doctor clean clean-release check-patches test-patched ci-release print-matrix e2e release-facts bench-e2e wheel

$(VENV)/.sglang-release: scripts/setup_venv.sh scripts/cpu_stubs/*.py scripts/cpu_stubs/*/*.py requirements/*.txt pyproject.toml
	scripts/setup_venv.sh $(SGLANG) $(VENV)

setup: $(VENV)/.sglang-release

# SGLANG_DISAGG_EXT_REQUIRE_ALL=1 (set by .ci/run): a skip for a missing required part
# (engine, MoRI stand-in, plugin module) fails instead (test/conftest.py).
test: setup
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# The CI matrix: every release with a live bug plus the pass-through smoke.
# Every release runs even when an earlier one fails; the exit status says whether any did.
test-all:
	@failed=""; for r in $(MATRIX); do \
	  echo "=== SGLang $$r ==="; \
	  $(MAKE) --no-print-directory test SGLANG=$$r || failed="$$failed $$r"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-all: failed on:$$failed"; exit 1; fi

# The real-server stage: SGLang's own server processes on this CPU (a colocated server and
# 1P1D pairs with SGLang's router through launch-pd --device cpu), one pytest process.
e2e: setup
	$(PY) -m pytest -p no:xdist test/servers $(PYTEST_ARGS)

mixed: setup
	@set -e; first=1; for r in $(MIXED_DECODES_$(SGLANG)); do \
	  $(MAKE) --no-print-directory setup SGLANG=$$r; \
	  if [ "$$r" = "$(DEFAULT_SGLANG)" ]; then dpy=.venv/bin/python; else dpy=.venv-$$r/bin/python; fi; \
	  if [ $$first = 1 ]; then only=""; else only="-k mooncake"; fi; \
	  SGLANG_DISAGG_EXT_DECODE_PYTHON=$$dpy $(PY) -m pytest -n 2 test/mixed --ignore=test/mixed/servers $$only $(PYTEST_ARGS); \
	  if [ $$first = 1 ]; then \
	    SGLANG_DISAGG_EXT_DECODE_PYTHON=$$dpy $(PY) -m pytest -p no:xdist test/mixed/servers $(PYTEST_ARGS); \
	  fi; \
	  first=0; \
	done

demo: setup
	$(VENV)/bin/sglang-disagg-ext doctor
	$(VENV)/bin/sglang-disagg-ext selftest

doctor: setup
	$(VENV)/bin/sglang-disagg-ext doctor

# Every release's patches still apply to that release's pinned sources (its venv).
check-patches:
	@set -e; for r in $(PATCH_RELEASES); do \
	  $(MAKE) --no-print-directory setup SGLANG=$$r; \
	  python3 scripts/apply_patches.py $$r --check; \
	done

# The differential tests with SGLang's own classes running the patched sources:
# stock must pass every fix the patches carry (scripts/apply_patches.py). The F5 retract
# tests run 100 cycles here (1,000 in `make test`; see test_retract_f5.py).
test-patched: setup
	rm -rf $(PATCHED)
	$(PY) scripts/apply_patches.py $(SGLANG) $(PATCHED)
	PYTHONPATH=$(CURDIR)/$(PATCHED) SGLANG_DISAGG_EXT_RETRACT_CYCLES=100 $(PY) -m pytest $(XDIST) $(PATCHED_TESTS) $(PYTEST_ARGS)

bench: setup
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/bench.txt
	$(PY) -m bench.run

# The figure users feel: TTFT and decode tokens/s through real PD pairs, -ext over stock
# (bench/e2e.py; writes bench/results.json key e2e).
bench-e2e: setup
	$(PY) -m bench.e2e $(BENCH_E2E_ARGS)

# A wheel that knows the commit it was built from (build_info).
wheel:
	git rev-parse --short=12 HEAD > sglang_disagg_ext/_commit.txt
	python3 -m pip wheel --no-deps --no-build-isolation -w dist . ; rc=$$?; rm -f sglang_disagg_ext/_commit.txt; exit $$rc

# The long soak: stock and -ext side by side; CI runs a short one in `make test`
# (test/integration/test_soak_engine.py). SOAK_ARGS adds to or overrides the options.
SOAK_ARGS ?=
soak: setup
	$(VENV)/bin/sglang-disagg-ext selftest --soak --requests 4096 --wave 64 $(SOAK_ARGS)

clean:
	rm -rf .venv .venv-* .patched-*

# One release's venv and patched copy; CI frees each release's ~3 GB before the next.
clean-release:
	rm -rf $(VENV) $(PATCHED)

# Record every release's probe values in sglang_disagg_ext/release_facts.json (releases.families):
# a throw-away venv per release (SETUP_COMPILE=0), its row written, the venv deleted.
release-facts:
	@set -e; for r in $(ALL_RELEASES); do \
	  SETUP_COMPILE=0 scripts/setup_venv.sh $$r .venv-facts-$$r >/dev/null; \
	  .venv-facts-$$r/bin/python scripts/record_release_facts.py 2>/dev/null; \
	  rm -rf .venv-facts-$$r; \
	done

print-matrix:
	@echo $(MATRIX)

# Every CI stage for one release, then its disk is freed: the tests, and where
# patches/<release>/ exists, the patch check and the patched-stock tests.
# At most one venv exists at a time (four side by side filled a CI disk).
# Every stage runs; the exit status says whether any failed.
# The "--- ci-release <release>: <stage> ---" lines let .ci/run count each stage's skips.
# The newest release's leg runs the whole suite, every other leg the tests of the fixes it proves
# (scripts/ci_plan.py tests).
ci-release:
	@failed=""; \
	echo "--- ci-release $(SGLANG): test ---"; \
	$(MAKE) --no-print-directory test PYTEST_ARGS="$(PYTEST_ARGS) $$(python3 scripts/ci_plan.py tests $(SGLANG))" || failed="$$failed test"; \
	if echo " $(E2E_RELEASES) " | grep -q " $(SGLANG) "; then \
	  echo "--- ci-release $(SGLANG): e2e ---"; \
	  $(MAKE) --no-print-directory e2e PYTEST_ARGS='$(PYTEST_ARGS) $(E2E_CI_ARGS_$(SGLANG))' || failed="$$failed e2e"; \
	fi; \
	if [ -n "$(MIXED_DECODES_$(SGLANG))" ]; then \
	  echo "--- ci-release $(SGLANG): mixed ---"; \
	  $(MAKE) --no-print-directory mixed PYTEST_ARGS='$(PYTEST_ARGS)' || failed="$$failed mixed"; \
	  for r in $(MIXED_DECODES_$(SGLANG)); do $(MAKE) --no-print-directory clean-release SGLANG=$$r; done; \
	fi; \
	if [ -d patches/$(SGLANG) ]; then \
	  echo "--- ci-release $(SGLANG): check-patches ---"; \
	  $(MAKE) --no-print-directory check-patches PATCH_RELEASES=$(SGLANG) || failed="$$failed check-patches"; \
	fi; \
	if [ -d patches/$(SGLANG) ] && echo " $(PATCH_TEST_RELEASES) " | grep -q " $(SGLANG) "; then \
	  echo "--- ci-release $(SGLANG): test-patched ---"; \
	  $(MAKE) --no-print-directory test-patched || failed="$$failed test-patched"; \
	fi; \
	$(MAKE) --no-print-directory clean-release; \
	if [ -n "$$failed" ]; then echo "ci-release $(SGLANG): failed:$$failed"; exit 1; fi
