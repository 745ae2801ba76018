"""Distribution: how an Engine is launched (spawn or torchrun) and where it sits in the job."""
