# images/images.mk: the image targets, included by the top-level Makefile
# (`-include images/images.mk`). On a machine with Docker (and, for the GPU flavours, the
# NVIDIA Container Toolkit or the amdgpu driver):
#
#   make images        wheelhouse + build of all three flavours
#   make trial-cuda    wheelhouse -> image -> the trial inside it, on the GPUs; manifest in out/cuda/
#   make trial-rocm    the same on AMD GPUs (out/rocm/)
#   make trial-cpu     the same on the CPU (out/cpu/)
#   make wheelhouse-cuda   only download the locked wheels (also -rocm, -cpu)
#   make base-local    the local Debian base (debootstrap; no registry needed): then
#                      `make trial-cpu LOCAL_BASE=1` builds on it
#
# Knobs: TRIAL_ARGS (what runs inside, default the tiny example), GPUS (all or 0,1),
# WHEEL_FLAGS (e.g. --extra-index-url URL for the GPU torch wheels), BUILD_FLAGS
# (e.g. --base-image REF), LOCAL_BASE=1 (build the CPU image on `make base-local`'s base),
# CODE (the code fingerprinted inside, mounted read-only; default this checkout),
# CACHE (HF hub cache to mount read-only).

CAPTURE     ?= $(if $(BIN),$(BIN)/capture,capture)
IMAGE_OUT   ?= out
GPUS        ?= all
TRIAL_ARGS  ?= trial --example tiny -o /out/trial.toml
WHEEL_FLAGS ?=
BUILD_FLAGS ?=
CACHE       ?=
CODE        ?= $(CURDIR)
LOCAL_BASE  ?=
LOCAL_BASE_IMAGE := capture-local/bookworm-python:base
RUN_FLAGS    = --code $(CODE) $(if $(CACHE),--cache $(CACHE))
IMAGE_VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' capture/__init__.py)
# The lead's Makefile provides `setup` (the venv with capture installed); use it when present.
IMAGE_DEPS  := $(if $(BIN),setup,)

IMAGE_FLAVOURS := cuda rocm cpu
.PHONY: images base-local $(addprefix trial-,$(IMAGE_FLAVOURS)) $(addprefix image-,$(IMAGE_FLAVOURS)) \
        $(addprefix wheelhouse-,$(IMAGE_FLAVOURS))

images: $(addprefix image-,$(IMAGE_FLAVOURS))

# Static pattern rules: make skips implicit rules for phony targets.
$(addprefix wheelhouse-,$(IMAGE_FLAVOURS)): wheelhouse-%: $(IMAGE_DEPS)
	$(CAPTURE) image wheelhouse $* $(WHEEL_FLAGS)

# Builds print the image ID; the tag is capture-FLAVOUR:VERSION.
$(addprefix image-,$(IMAGE_FLAVOURS)): image-%: wheelhouse-%
	$(CAPTURE) image build $* --tag capture-$*:$(IMAGE_VERSION) $(WHEEL_FLAGS) $(BUILD_FLAGS) \
	  $(if $(and $(LOCAL_BASE),$(filter cpu,$*)),--base-image $(LOCAL_BASE_IMAGE))

# The trial inside, then its verification inside (the live stack there is the image's).
trial-cuda trial-rocm: trial-%: image-%
	$(CAPTURE) run --image capture-$*:$(IMAGE_VERSION) --gpus $(GPUS) --out $(IMAGE_OUT)/$* $(RUN_FLAGS) -- $(TRIAL_ARGS)
	$(CAPTURE) run --image capture-$*:$(IMAGE_VERSION) --gpus $(GPUS) --out $(IMAGE_OUT)/$* $(RUN_FLAGS) -- verify /out/trial.toml

trial-cpu: image-cpu
	$(CAPTURE) run --image capture-cpu:$(IMAGE_VERSION) --out $(IMAGE_OUT)/cpu $(RUN_FLAGS) -- $(TRIAL_ARGS)
	$(CAPTURE) run --image capture-cpu:$(IMAGE_VERSION) --out $(IMAGE_OUT)/cpu $(RUN_FLAGS) -- verify /out/trial.toml

base-local:
	bash .ci/docker.sh
