package kubeclient

import "k8s.io/client-go/util/flowcontrol"

// flowcontrolLimiter is the token bucket kubernetes.NewForConfig installs,
// shared by every group's client so that QPS and burst are the plugin's in
// all.
func flowcontrolLimiter(qps float32, burst int) flowcontrol.RateLimiter {
	return flowcontrol.NewTokenBucketRateLimiter(qps, burst)
}
