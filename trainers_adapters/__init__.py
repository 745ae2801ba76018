"""hotswap.trainers_adapters: for trainers that drive SGLang or vLLM (docs/rl.md#trainer-adapters).

Modules: sglang (Engine), vllm (LLM, SamplingParams, RequestOutput), openrlhf (the rollout
actor), verl (the rollout adapter, registered with verl when importable), trl (VLLMClient and a
GRPOTrainer backend), groups (the trainers' process-group helpers over hotswap's protocol).
Each is imported on its own; none imports its framework unless that framework is installed.
"""
