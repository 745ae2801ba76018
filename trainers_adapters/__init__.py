"""hotswap.trainers_adapters: for trainers that drive SGLang or vLLM (docs/rl.md#trainer-adapters).

Modules: sglang (Engine), vllm (LLM, SamplingParams, RequestOutput), openrlhf (OpenRLHF's
rollout actor and create_vllm_engines), verl (a package: verl's rollout replica, server actor,
BaseRollout and CPU platform, registered with verl as its plugin), trl (VLLMClient and a
GRPOTrainer backend), groups (the trainers' process-group helpers over hotswap's protocol).
Each is imported on its own; none imports its framework unless that framework is installed,
and Ray only inside the functions that use it.
"""
