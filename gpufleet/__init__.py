"""gpufleet: GLM-5.3 serving deployments on bare-metal GPU fleets."""
