package provider

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/gpudra/gpudra/devcluster/cloudapi"
)

// CloudClient calls devcluster's cloud (devcluster/cloud) on its unix
// socket.
type CloudClient struct {
	http *http.Client
}

// ErrNotFound: the cloud has no such machine.
var ErrNotFound = errors.New("not found")

// NewCloudClient talks to the cloud on socket.
func NewCloudClient(socket string) *CloudClient {
	return &CloudClient{http: &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", socket)
		}}}}
}

// InstanceTypes are the types on sale under cfg.
func (c *CloudClient) InstanceTypes(ctx context.Context, cfg cloudapi.Configuration) ([]cloudapi.InstanceType, error) {
	q := url.Values{"migMode": {strconv.FormatBool(cfg.MIGMode)}, "migDevices": {cfg.MIGDevices}, "fractionalGPUs": {strconv.FormatBool(cfg.FractionalGPUs)}}
	var out []cloudapi.InstanceType
	return out, c.do(ctx, http.MethodGet, cloudapi.InstanceTypesPath+"?"+q.Encode(), nil, &out)
}

// Create buys a machine.
func (c *CloudClient) Create(ctx context.Context, req cloudapi.MachineRequest) (cloudapi.Machine, error) {
	var out cloudapi.Machine
	return out, c.do(ctx, http.MethodPost, cloudapi.MachinesPath, req, &out)
}

// Get is a machine; ErrNotFound once it is gone.
func (c *CloudClient) Get(ctx context.Context, name string) (cloudapi.Machine, error) {
	var out cloudapi.Machine
	return out, c.do(ctx, http.MethodGet, cloudapi.MachinesPath+"/"+url.PathEscape(name), nil, &out)
}

// List is every machine.
func (c *CloudClient) List(ctx context.Context) ([]cloudapi.Machine, error) {
	var out []cloudapi.Machine
	return out, c.do(ctx, http.MethodGet, cloudapi.MachinesPath, nil, &out)
}

// Delete terminates a machine; ErrNotFound if it is gone already.
func (c *CloudClient) Delete(ctx context.Context, name string) error {
	return c.do(ctx, http.MethodDelete, cloudapi.MachinesPath+"/"+url.PathEscape(name), nil, nil)
}

func (c *CloudClient) do(ctx context.Context, method, path string, in, out any) error {
	var body bytes.Buffer
	if in != nil {
		if err := json.NewEncoder(&body).Encode(in); err != nil {
			return err
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://devcluster-cloud"+path, &body)
	if err != nil {
		return err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("devcluster cloud: %s %s: %w", method, path, err)
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode >= 300 {
		var e cloudapi.Error
		_ = json.NewDecoder(resp.Body).Decode(&e)
		err := fmt.Errorf("devcluster cloud: %s %s: %s: %s", method, path, resp.Status, e.Message)
		if resp.StatusCode == http.StatusNotFound {
			return fmt.Errorf("%w: %w", ErrNotFound, err)
		}
		return err
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}
