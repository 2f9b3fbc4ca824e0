"""Deployment: CloudFormation for SageMaker and EC2/ALB, EKS manifests, the Grafana dashboard (data files
beside this package), the `inf2serve deploy sagemaker` helper and the `inf2serve canary` analysis."""
