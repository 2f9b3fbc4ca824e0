"""Deployment: CloudFormation for SageMaker and EC2/ALB, EKS manifests and the Grafana dashboard (files in
the source tree, not in the installed package), the `inf2serve deploy sagemaker` helper and the
`inf2serve canary` analysis."""
