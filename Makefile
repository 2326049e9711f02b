# The course's commands. Each one sets up what it needs first.
#   make lab        install everything in .venv and open the course in JupyterLab
#                   (in my-work/: your own copy of notebooks/, made once, never overwritten)
#   make grade SUBMISSIONS="class/"  grade handed-in notebooks into gradebook/ (GRADE_ARGS="--jobs 4 ...")
#   make release    student notebooks + course_utils wheel + learner README in RELEASE_DIR/ and
#                   RELEASE_DIR.zip, to hand out through an LMS (RELEASE_DIR=dist/release unless given)
#   make test       install everything in .venv and run the whole test suite
#   make notebooks  regenerate notebooks/ from solutions/
#   make solutions  re-execute the solution notebooks in place
#   make doctor     report this machine (GPU, versions, interpreter)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Without a GPU we pin exact versions (constraints/ci.txt: CPU torch, triton
# 3.8). With one (nvidia-smi present) we keep pip's choice, so torch's CUDA
# build brings the triton it was built with.
CONSTRAINTS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,constraints/ci.txt)
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
# On PyPI itself, torch==2.13.0 for Linux is the CUDA build (several GB). On a
# machine without a GPU, `make setup TORCH_CPU=1` (or lab/test) takes PyTorch's
# CPU build from PyTorch's own wheel index instead (about 200 MB).
TORCH_CPU ?=
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_INDEX := $(if $(TORCH_CPU),--extra-index-url $(TORCH_INDEX),)

.PHONY: setup lab test notebooks solutions doctor grade release

$(VENV)/.installed: pyproject.toml constraints/ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "Installing the course and its dependencies (torch and triton are large: this takes minutes)..."
	$(PY) -m pip install --progress-bar on $(PIP_INDEX) $(PIP_C) -e ".[test]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

setup: $(VENV)/.installed

lab: setup
	$(PY) -m pip install -q $(PIP_INDEX) $(PIP_C) -e ".[test,lab]"
	$(PY) -m course_utils || true
	@mkdir -p my-work
	@for f in notebooks/*.ipynb; do [ -e "my-work/$${f##*/}" ] || cp "$$f" my-work/; done
	$(VENV)/bin/jupyter lab my-work/ $(if $(filter 0,$(shell id -u)),--allow-root,)

# The test command: unit tests (with the notebooks/ sync check) and nbval
# over every solution notebook (in Triton's interpreter when there is no GPU).
# TEST_JOBS processes (pytest-xdist; loadfile keeps each file, so each notebook, in one of them): on the
# 2-core CI machine 2 take 12 minutes where one takes 17. TEST_JOBS=0 runs everything in this process.
TEST_JOBS ?= 2
test: setup
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile tests/ --nbval-lax --nbval-current-env solutions/ -p no:cacheprovider

notebooks: setup
	$(PY) -m course_utils.build

solutions: setup
	$(PY) -m course_utils.build --execute

doctor: setup
	$(PY) -m course_utils

# Grade handed-in notebooks: SUBMISSIONS is one or more <root>/<learner>/<notebook>.ipynb
# folders (or .ipynb files); writes gradebook/ (see README, "For instructors").
grade: setup
	@test -n "$(SUBMISSIONS)" || { echo 'usage: make grade SUBMISSIONS="class/" [GRADE_ARGS="--jobs 4"]'; exit 2; }
	$(PY) -m course_utils.grade $(SUBMISSIONS) $(GRADE_ARGS)

# Hand out the course without a public repository (see README, "For instructors"):
# the student notebooks, a wheel of course_utils and a README for learners.
RELEASE_DIR ?= dist/release
release: setup
	$(PY) -m course_utils.release $(RELEASE_DIR)
