"""Agent loops: how one row becomes a group of trajectories.

`SingleTurn`: one request with n=G, so the prompt is prefilled once for the whole group.
`ToolLoop` (tool_loop.py): multi-turn with tool calls, appended as token deltas of the template.
"""

from __future__ import annotations

from typing import Any

from hotswap.rollout.client import TokenClient, row_images
from hotswap.rollout.trajectory import Trajectory


class SingleTurn:
    def __init__(self, **sampling: Any):
        """sampling: overrides of the client's sampling params for this loop."""
        self.sampling = sampling

    def run_group(self, client: TokenClient, row: dict, group_size: int, group_id: int,
                  seed: int | None = None) -> list[Trajectory]:
        """A row's optional "sampling" dict overrides the loop's and the client's params; its
        images (client.row_images) go with the prompt."""
        prompt = client.encode_row(row)
        images = row_images(row)
        params = {**self.sampling, **row.get("sampling", {})}
        if seed is not None:
            params.setdefault("seed", seed)
        comps = client.generate(prompt, n=group_size, image_data=images, **params)
        trajs = []
        for k, comp in enumerate(comps):
            # with images the engine's expanded prompt, which is what the trainer must score
            traj = Trajectory(prompt_ids=comp.prompt_ids or prompt, finish_reason=comp.finish_type,
                              group_id=group_id, sample_idx=k, row=row, text=comp.text,
                              images=images or [], image_meta=comp.image_meta)
            traj.append_generated(comp.output_ids, comp.logprobs, comp.versions,
                                 comp.routed_experts)
            trajs.append(traj)
        return trajs
