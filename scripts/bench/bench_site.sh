# Sourced by the bench scripts (run from the repo root): the GPU environment they share, and the site folder of
# carried wheels. The device image has no package registry, so .whl/ (DeepSpeed and its pure-Python needs)
# is installed once per machine into $SITE, which outlives a command on a warm machine.
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 DS_ACCELERATOR=cuda  # 9.0a breaks DeepSpeed's op JIT
SITE=${BENCH_SITE:-/tmp/site}
# a carried folder of wheels ($1), installed once per machine: skipped where $SITE already holds package $2; more
# pip arguments after those
install_carried() {
  local dir=$1 package=$2; shift 2
  if [ -d "$dir" ] && [ ! -d "$SITE/$package" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@" --target "$SITE" "$dir"/*.whl
  fi
}
install_carried .whl deepspeed --upgrade
# Liger-Kernel (the anchors' --liger and our model.kernels=liger): the device image of 2026-12-06 had none, so it is
# carried too, in .lig/ (`pip download --no-deps liger-kernel==0.8.5`)
install_carried .lig liger_kernel
# torchao (precision=fp8 and the anchors' --fp8), carried in .tao/ (`pip download --no-deps torchao==0.18.0`) where the
# image lacks it
install_carried .tao torchao
# transformers at the pinned version (.tfw/, `pip download --no-deps transformers==5.22.2`): the image's 5.17 lacks
# Mistral-4, GPT-OSS's swiglu_alpha and Qwen3-VL's text model as AutoModelForCausalLM (the GPU matrix's cells)
install_carried .tfw transformers
# a --target install skips .pth files: add nvidia_cutlass_dsl's (FA4, bench_gpu.sh site_fa4) by hand
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
