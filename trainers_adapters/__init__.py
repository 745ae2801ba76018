"""hotswap.trainers_adapters: drop hotswap in where a trainer drives SGLang or vLLM (API.md 7).

Modules: sglang (Engine), vllm (LLM, SamplingParams, RequestOutput), openrlhf (the rollout
actor), verl (the rollout adapter, registered with verl when importable), trl (VLLMClient and a
GRPOTrainer backend), groups (the trainers' process-group helpers over hotswap's protocol).
Each is imported on its own; none imports its framework unless that framework is installed.
"""
