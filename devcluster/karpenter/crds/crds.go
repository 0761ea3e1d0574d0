// Package crds holds devcluster's NodeClass CRD.
package crds

import _ "embed"

// GPUNodeClass is the GPUNodeClass CRD.
//
//go:embed karpenter.devcluster.gpudra.dev_gpunodeclasses.yaml
var GPUNodeClass []byte
