//go:build tools

// Package podgroups pins the Go types that Volcano's PodGroup CRD is generated from, so that
// controller-gen (the module's tool) loads exactly the version the training-operator links.
package podgroups

import _ "volcano.sh/apis/pkg/apis/scheduling/v1beta1"
